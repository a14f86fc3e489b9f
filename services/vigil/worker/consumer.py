"""The consumer thread: poll, record in the ledger, then store the offsets.

The commit order, which tests/test_worker_*.py pin down:

1. Poll what has arrived, up to ``VIGIL_POLL_BATCH_MAX`` messages (waiting only for the
   first one when nothing has).
2. Undecodable messages: copy to the dead-letter topic and wait for the acknowledgement.
3. Record every decoded event in one transaction: a binary COPY into the connection's
   staging table, then one statement inserting new users' home partitions, the events
   (duplicates dropped by the UNIQUE key) and each partition's next offset in
   ``consumer_positions``, pipelined with the commit. This runs on a second thread, the
   recorder, while this thread polls and decodes the next batch: the two overlap, the
   decode on this core and the statement in PostgreSQL, instead of taking turns. Several
   ledger shards: one such transaction per shard, each holding its partitions' events and
   positions; an event whose user's home partition is on another shard is produced again
   there first (:meth:`ConsumerLoop._reroute`), not recorded here.
4. Only once that commit is done, store the batch's offsets (``enable.auto.offset.store=
   false``); the periodic auto-commit sends stored offsets to the broker. Batches are
   settled in the order they were polled, one in flight at a time, and the one in flight
   is settled before this thread blocks on an empty topic, so nothing waits on the next
   message. A crash before 4 re-reads messages that are already recorded, and the UNIQUE
   key makes that a no-op.
5. Wake the run loop if any event was new.

The ledger, not the group's committed offset, decides what was consumed: on assignment each
partition resumes at the ledger's position (the committed offset only for a partition the
ledger has never recorded from). A ledger that lost its last commits (asynchronous commit
and a crash, a failover to an asynchronous replica, a restored backup) lost the positions
with them, so those events are read again and recorded; the Kafka offsets are still
committed, for lag monitoring and for partitions the ledger has not seen.

Rebalances: an assignment is a takeover in the ledger (:mod:`vigil.worker.fencing`), after
the previous owner's hand-over, before any claim is made for it. A partition still being
handed over is recorded at once and taken over later, by a thread of its own once the
hand-over ends (recording is not fenced: the dedup key and the GREATEST position make a late
or repeated batch harmless; claims are), so the consumer never waits for another worker's
runs, and its other partitions go on being recorded meanwhile. A revoke hands the
partition's runs over (they finish or are released in the background, the ledger holding
the next takeover until then: fencing rule 4), then commits the stored offsets
synchronously; a *lost* partition (session timed out) commits nothing, because another
worker may already have committed past us.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, NamedTuple, cast

import psycopg
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition
from psycopg.rows import DictRow

from vigil import tracing
from vigil.bus.codec import DecodeError, EventCodec
from vigil.bus.kafka import ProduceError
from vigil.clock import Clock, utc
from vigil.ledger import events as ledger_events
from vigil.ledger import partitions as ledger_partitions
from vigil.ledger import recovery as ledger_recovery
from vigil.ledger.db import AsyncPool, connect
from vigil.ledger.events import USER_COLUMN, prepare_record_connection
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics, traces
from vigil.worker.fencing import handing_over, take_over, wait_for_handover
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import CATALOG, Shards

log = logging.getLogger(__name__)

RETRY_S = 1.0
# take_over's wait for a hand-over, when the caller knows none is in progress or has waited.
HANDOVER_WITHIN_NONE = 0.0
# librdkafka's statistics (the consumer lag gauges): VIGIL_KAFKA_OPT_STATISTICS_INTERVAL_MS
# overrides it, as the tests that wait for a report do.
STATS_INTERVAL_MS = 15_000


# A broker answers the worker's fetch once this much waits for it, or after this long. With
# librdkafka's defaults (1 byte, 500 ms) every fetch was answered at once, so under load the
# broker served one per few messages. At 7,700 events/s: the broker's CPU 13.9 -> 11.6 s over
# the same rounds; the e2e bench 14,735 -> 15,581 events/s with one worker, 16,592 -> 18,513
# with two (docs/performance.md, change 15). An event at low load waits at most the 10 ms
# more (5 at the median at 200 events/s). VIGIL_KAFKA_OPT_FETCH_* override them.
FETCH_MIN_BYTES = 64 * 1024
FETCH_WAIT_MAX_MS = 10


def consumer_config(settings: WorkerSettings, on_stats) -> dict[str, Any]:
    config: dict[str, Any] = {
        "fetch.min.bytes": FETCH_MIN_BYTES,
        "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
        "statistics.interval.ms": STATS_INTERVAL_MS,
    }
    config.update(settings.kafka_client_options())
    config.update(
        {
            "group.id": settings.worker_group,
            "client.id": f"vigil-worker-{settings.instance_id}",
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.auto.commit": True,
            # Offsets are stored by hand, after the ledger commit (step 4 above).
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": settings.kafka_session_timeout_ms,
            # A member learns that a rebalance began from its next heartbeat: every rebalance
            # (a join, a hand-over's second round, a failover) waits up to one interval for
            # each member. A tenth of the session (1 s by default) instead of a fifth: the
            # rebalance bench's moved partitions reached the next owner's ledger 1.88 s after
            # the hand-over began with a fifth (docs/performance.md, "Rebalances").
            "heartbeat.interval.ms": max(500, settings.kafka_session_timeout_ms // 10),
            "max.poll.interval.ms": settings.kafka_max_poll_interval_ms,
            "stats_cb": on_stats,
        }
    )
    return config


# How long an idle poll waits for the next message. A poll never waits for a *full* batch:
# consume(n, timeout) returns only when n messages came or the timeout passed, which at a
# moderate rate held every event back by up to the whole timeout before it was recorded.
IDLE_POLL_S = 0.2


def read_positions(conn: psycopg.Connection[DictRow], keys: list[PartitionKey]) -> dict[PartitionKey, int]:
    """The ledger's next offset for each of ``keys`` it has recorded from (read in its own transaction)."""
    positions = ledger_recovery.read_positions(conn, keys)
    conn.commit()
    return positions


# Bound of the known-users set (about 100 bytes each); past it the set starts over.
KNOWN_USERS_MAX = 500_000
PARTITION_COLUMN = -2  # a staging row's partition (``_decode``: ..., topic, partition, offset)


def _partition(key: PartitionKey) -> int:
    return key.partition


class Batch(NamedTuple):
    """What one shard's transaction records of a polled batch."""

    shard: int
    rows: list[tuple]
    highest: dict[tuple[str, int], int]  # its partitions' highest offsets polled
    unknown: list[str]  # its users this process has not seen committed there
    lowest: dict[tuple[str, int], int] | None = None  # several shards: where to read again if it fails


class Down(NamedTuple):
    """Several shards: one that did not take its batch. Its partitions are paused, to be read
    again from ``seek`` once it answers; the other shards' partitions go on."""

    seek: dict[PartitionKey, int]  # each paused partition's first offset not recorded
    probe_at: float  # monotonic: when to ask the shard again


class InFlight(NamedTuple):
    """A batch handed to the recorder thread and not yet settled."""

    recorded: Future  # Recorded, or None if the worker stopped before the ledger answered
    highest: dict[tuple[str, int], int]  # the offsets to store once it is committed
    rows: int
    users: dict[int, set[str]]  # per shard, whose users row exists there once it is committed
    spans: traces.RecordSpans | None = None  # traces on: the events' record spans, ended at the commit


class Recorded(NamedTuple):
    new: int  # events recorded (not duplicates)
    failed: list[Batch]  # several shards: the shards' batches that did not commit (their shard down)


class ConsumerLoop(threading.Thread):
    def __init__(
        self,
        settings: WorkerSettings,
        runner,
        loop: asyncio.AbstractEventLoop,
        dead_letters,
        stopping: threading.Event,
        clock: Clock | None = None,
        shards: Shards | None = None,
    ):
        super().__init__(name="consumer", daemon=True)
        self.settings = settings
        self.runner = runner
        self.loop = loop
        self.dead_letters = dead_letters
        self.stopping = stopping
        self.clock = clock  # the runner's: takeovers decide hand-overs and backoffs on it
        self.codec = EventCodec(settings.schema_registry_url)
        # Where each partition's events, positions and takeovers go (the run loop's map: an
        # assignment reads it again); a connection per shard, the catalog's as before.
        self.shards = shards or Shards(cast(AsyncPool, None))
        self.conns: dict[int, psycopg.Connection[DictRow]] = {}
        self.consumer: Consumer | None = None
        self.assigned: set[PartitionKey] = set()
        self.error: BaseException | None = None
        # The recorder: one thread, so batches commit in the order they were polled. It and
        # the rebalance callbacks share self.conns; the callbacks settle the batch in flight
        # before they touch it.
        self.recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")
        # Users whose users row (home partition) a committed batch of ours has seen, per shard:
        # the upsert of home partitions cost each batch an index probe per event for nothing.
        self.known_users: dict[int, set[str]] = {}
        self.in_flight: InFlight | None = None
        # Assigned partitions whose takeover waits for the previous owner's hand-over (a
        # thread each batch, :meth:`_take_over_later`). The lock orders a takeover against a
        # revoke of the same partition: whichever comes second sees what the first did.
        self.taking_over: set[PartitionKey] = set()
        self._takeover_lock = threading.Lock()
        self.abandoned = False  # a batch was given up (stopping with the ledger down): store no more offsets
        # Several shards: those that did not take a batch, their partitions paused meanwhile
        # (one shard: its outage is the worker's, retried in place as ever).
        self.down: dict[int, Down] = {}

    # -- ledger connection ------------------------------------------------------------

    def _dsn(self, shard: int) -> str:
        return self.settings.dsn if shard == CATALOG else self.settings.shard_dsns[shard]

    def _db(self, shard: int = CATALOG) -> psycopg.Connection[DictRow]:
        conn = self.conns.get(shard)
        if conn is None or conn.closed or conn.broken:
            conn = self.conns[shard] = connect(self._dsn(shard))
            prepare_record_connection(conn)
        return conn

    def _retrying(self, what: str, action, shard: int = CATALOG):
        """Run ``action(conn)`` on ``shard``'s connection until it succeeds or the worker
        stops (ledger outages)."""
        while True:
            try:
                return action(self._db(shard))
            except psycopg.OperationalError as exc:
                log.warning("%s failed (ledger shard %d unreachable?), retrying: %s", what, shard, exc)
                self.conns.pop(shard, None)
                if self.stopping.wait(RETRY_S):
                    raise

    def _per_shard(self, what: str, keys: list[PartitionKey], action) -> dict:
        """``action(conn, keys_of_shard)`` on each shard of ``keys``, its own transaction
        there; their answers (dicts or sets) merged."""
        merged: Any = None
        for shard, some in self.shards.split(keys, _partition).items():
            answer = self._retrying(what, lambda conn, some=some: action(conn, some), shard)
            merged = answer if merged is None else merged | answer
        return merged

    # -- rebalance callbacks (run inside consume(), on this thread) ----------------------

    def _call_runner(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_assign(self, consumer, partitions) -> None:
        keys = [PartitionKey(p.topic, p.partition) for p in partitions]
        if not keys:
            return
        self._settle()
        if not self.shards.single:  # a partition may have moved: the catalog's map again
            self._retrying("reading the shard map", lambda _conn: self.shards.reload())
        later = self._per_shard("reading hand-overs", keys, lambda conn, some: handing_over(conn, some, self.clock))
        now = [k for k in keys if k not in later]
        if now:
            epochs = self._per_shard(
                "takeover", now, lambda conn, some: self._take_over(conn, some, HANDOVER_WITHIN_NONE)
            )
            self._call_runner(self.runner.claimer.assign(epochs))
        self.assigned.update(keys)
        positions = self._per_shard("reading consumer positions", keys, read_positions)
        consumer.incremental_assign(
            [TopicPartition(k.topic, k.partition, positions.get(k, OFFSET_INVALID)) for k in keys]
        )
        resumed = {k.partition: offset for k, offset in sorted(positions.items())}
        log.info("resuming at the ledger's positions %s (others at the group's committed offset)", resumed)
        if later:
            with self._takeover_lock:
                self.taking_over.update(later)
                metrics.AWAITING_TAKEOVER.set(len(self.taking_over))
            log.info(
                "partitions %s: recording; taken over once the previous owner's hand-over ends",
                ", ".join(str(k.partition) for k in sorted(later)),
            )
            for shard, some in self.shards.split(sorted(later), _partition).items():
                threading.Thread(target=self._take_over_later, args=(some, shard), name="takeover", daemon=True).start()

    def _take_over(self, conn: psycopg.Connection[DictRow], keys: list[PartitionKey], within_s: float) -> dict:
        return take_over(
            conn,
            keys,
            self.settings.instance_id,
            self.settings.backoff_base_s,
            self.settings.backoff_cap_s,
            self.settings.max_attempts,
            within_s,
            self.clock,
            self.settings.lost_verdict_s,
        )

    def _take_over_later(self, keys: list[PartitionKey], shard: int = CATALOG) -> None:
        """Rule 4 off the consumer thread: wait for the previous owner's hand-over of ``keys``
        (at most half the poll interval, as before hand-overs the group bounded a revoke), then
        take over those still assigned and let the run loop claim for them. A revoke or a
        loss meanwhile drops them from ``taking_over``; the lock makes it wait for a takeover
        in progress, so the partition is handed on as ours, never taken over after it left.
        ``keys`` are all on ``shard``."""
        within_s = self.settings.kafka_max_poll_interval_ms / 2000

        def wanted() -> list[PartitionKey]:
            with self._takeover_lock:
                return [k for k in keys if k in self.taking_over]

        conn: psycopg.Connection[DictRow] | None = None
        deadline = time.monotonic() + within_s
        try:
            while not self.stopping.is_set() and wanted():
                try:
                    if conn is None or conn.closed or conn.broken:
                        conn = connect(self._dsn(shard))
                    left_s = max(deadline - time.monotonic(), 0.0)
                    wait_for_handover(conn, wanted(), left_s, given_up=lambda: not wanted(), clock=self.clock)
                    with self._takeover_lock:
                        left = [k for k in keys if k in self.taking_over]
                        if not left:
                            return
                        # Revoked and given back meanwhile, a partition may be in a later
                        # owner's hand-over: wait for that one too (within the same bound).
                        now = None if self.clock is None else utc(self.clock.now())
                        again = ledger_partitions.handover_left(conn, left, now=now) is not None
                        conn.commit()
                        if again and time.monotonic() < deadline:
                            continue
                        epochs = self._take_over(conn, left, HANDOVER_WITHIN_NONE)
                        self._call_runner(self.runner.claimer.assign(epochs))
                        self.taking_over.difference_update(left)
                        metrics.AWAITING_TAKEOVER.set(len(self.taking_over))
                    return
                except psycopg.OperationalError as exc:
                    log.warning(
                        "takeover after a hand-over failed (ledger unreachable?), retrying: %s",
                        exc,
                        extra={"event": "takeover_failed"},
                    )
                    conn = None
                    self.stopping.wait(RETRY_S)
        except BaseException as exc:  # as the consumer loop's own death: the worker exits non-zero
            self.error = exc
            log.exception("takeover after a hand-over died", extra={"event": "loop_died"})
            self.stopping.set()
        finally:
            if conn is not None:
                conn.close()

    def on_revoke(self, consumer, partitions) -> None:
        keys = [PartitionKey(p.topic, p.partition) for p in partitions]
        self._settle()  # the batch in flight stores its offsets before they are committed
        # The partitions' runs get VIGIL_REVOKE_GRACE_S to finish, as a hand-over: this returns
        # once the ledger has its deadline, and recording goes on (only if the ledger cannot
        # take it does the grace pass here).
        grace_s = self.settings.revoke_grace_s
        self._forget_takeovers(keys)
        self._forget_down(consumer, keys)
        self._call_runner(self.runner.claimer.hand_over(keys, grace_s), timeout=grace_s + 60.0)
        try:
            consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                log.warning("offset commit on revoke failed: %s", exc)
        self.assigned.difference_update(keys)
        _forget_lag(keys)

    def _forget_down(self, consumer, keys: list[PartitionKey]) -> None:
        """Revoked or lost while paused for their shard: resumed as they go (a later owner reads
        them from the ledger's position); the shard is still probed, to report it up again."""
        gone = [k for down in self.down.values() for k in down.seek if k in keys]
        for down in self.down.values():
            for k in gone:
                down.seek.pop(k, None)
        if gone:
            consumer.resume([TopicPartition(k.topic, k.partition) for k in gone])

    def _forget_takeovers(self, keys: list[PartitionKey]) -> None:
        """Revoked or lost before their takeover: never take them over (waits for one in
        progress, which then owns them, and the revoke hands them on)."""
        with self._takeover_lock:
            self.taking_over.difference_update(keys)
            metrics.AWAITING_TAKEOVER.set(len(self.taking_over))

    def on_lost(self, consumer, partitions) -> None:
        keys = [PartitionKey(p.topic, p.partition) for p in partitions]
        log.warning("partitions lost (session timed out): %s; committing nothing", [k.partition for k in keys])
        self._forget_takeovers(keys)
        self._forget_down(consumer, keys)
        self._call_runner(self.runner.claimer.revoke(keys, release=False))
        self.assigned.difference_update(keys)
        _forget_lag(keys)

    def on_stats(self, raw: str) -> None:
        try:
            stats = json.loads(raw)
            partitions = stats.get("topics", {}).get(self.settings.events_topic, {}).get("partitions", {})
            metrics.TOPIC_PARTITIONS.set(sum(1 for partition in partitions if int(partition) >= 0))
            for partition, info in partitions.items():
                lag = _lag(info)
                # Only partitions this worker holds: a revoked one's series is removed, and
                # librdkafka may keep reporting it for a while after the revoke.
                held = PartitionKey(self.settings.events_topic, int(partition)) in self.assigned
                if int(partition) >= 0 and lag >= 0 and held:
                    metrics.CONSUMER_LAG.labels(partition).set(lag)
        except (ValueError, AttributeError):
            pass

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported to the main thread, which exits non-zero
            self.error = exc
            log.exception("consumer loop died", extra={"event": "loop_died"})
            self.stopping.set()

    def _run(self) -> None:
        self.consumer = Consumer(consumer_config(self.settings, self.on_stats))
        self.consumer.subscribe(
            [self.settings.events_topic], on_assign=self.on_assign, on_revoke=self.on_revoke, on_lost=self.on_lost
        )
        try:
            while not self.stopping.is_set():
                messages = self._poll()
                if messages:
                    self._handle(messages)
                if self.down:
                    self._probe_down()
        finally:
            try:
                self._settle()
            finally:
                # close() revokes the assignment (our on_revoke releases runs and commits).
                self.consumer.close()
                self.recorder.shutdown()
                for conn in self.conns.values():
                    conn.close()

    def _poll(self) -> list:
        """What has arrived, up to a batch; when nothing has, wait for the first message only.

        Batches form by themselves under load (whatever arrived while the last one was being
        recorded), and a lone event is recorded as soon as it arrives.
        """
        batch = self.settings.poll_batch_max
        consumer = self.consumer
        assert consumer is not None  # made before the poll loop starts
        messages = consumer.consume(num_messages=batch, timeout=0)
        if messages:
            return messages
        self._settle()  # before waiting: the batch in flight's offsets and wake-up must not wait too
        messages = consumer.consume(num_messages=1, timeout=IDLE_POLL_S)
        if messages and batch > 1:
            messages += consumer.consume(num_messages=batch - 1, timeout=0)
        return messages

    def _handle(self, messages: list) -> None:
        rows, bad, highest, spans = self._decode(messages)
        if bad:
            while True:
                try:
                    self.dead_letters.publish_undecodable(bad)
                    break
                except ProduceError as exc:
                    log.warning("dead-letter produce failed, retrying: %s", exc)
                    if self.stopping.wait(RETRY_S):
                        return
            metrics.EVENTS_UNDECODABLE.inc(len(bad))
            log.warning("%d undecodable message(s) sent to %s: %s", len(bad), self.settings.dlq_topic, bad[0][1])
        if rows and not self.shards.single:
            kept = self._reroute(rows, messages)
            if kept is None:
                return
            rows = kept
        self._settle()
        if self.down:  # polled before their shard's pause took effect: read again on resume
            paused = {(k.topic, k.partition) for d in self.down.values() for k in d.seek}
            rows = [r for r in rows if (r[PARTITION_COLUMN - 1], r[PARTITION_COLUMN]) not in paused]
            highest = {tp: offset for tp, offset in highest.items() if tp not in paused}
        if highest:
            if self.shards.single:
                batches = [Batch(CATALOG, rows, highest, [])]
            else:
                batches = self._by_shard(rows, highest, messages)
            users: dict[int, set[str]] = {}
            for b in batches:
                users[b.shard] = {row[USER_COLUMN] for row in b.rows}
                b.unknown.extend(sorted(users[b.shard] - self.known_users.get(b.shard, set())))
            self.in_flight = InFlight(self.recorder.submit(self._record, batches), highest, len(rows), users, spans)

    def _reroute(self, rows: list[tuple], messages: list) -> list[tuple] | None:
        """Several shards: the rows to record here; those whose user's home partition is on
        another shard (a producer with another partitioner, a topic grown past
        VIGIL_PARTITIONS) are produced again, verbatim, to that partition and acknowledged
        first, so their offsets are stored only after that (a crash in between produces them
        again: the home shard's dedup key drops the copy). None: the worker stopped first."""
        kept: list[tuple] = []
        away: dict[int, list[tuple]] = {}
        for row in rows:
            home = self.shards.elsewhere(row[USER_COLUMN], row[PARTITION_COLUMN], partitions=self.settings.partitions)
            if home is None:
                kept.append(row)
            else:
                away.setdefault(home, []).append(row)
        if not away:
            return rows
        read = {(m.partition(), m.offset()): m for m in messages}
        for home, foreign in sorted(away.items()):
            copies = [(m.key(), m.value(), m.headers()) for m in (read[r[PARTITION_COLUMN], r[-1]] for r in foreign)]
            while True:
                try:
                    self.dead_letters.producer.send_raw(copies, self.settings.events_topic, partition=home)
                    break
                except ProduceError as exc:
                    log.warning("producing events again to their home partition failed, retrying: %s", exc)
                    if self.stopping.wait(RETRY_S):
                        return None
            metrics.EVENTS_REROUTED.inc(len(foreign))
            log.info(
                "%d event(s) read on partition(s) of another shard produced again to their home partition %d",
                len(foreign),
                home,
            )
        return kept

    def _by_shard(self, rows: list[tuple], highest: dict[tuple[str, int], int], messages: list) -> list[Batch]:
        """A polled batch split by the shard of each partition: its events and positions, and
        each partition's first offset polled (where to read again if its shard fails)."""
        batches: dict[int, Batch] = {}
        for (topic, partition), offset in highest.items():
            shard = self.shards.shard_of(partition)
            batches.setdefault(shard, Batch(shard, [], {}, [], {})).highest[topic, partition] = offset
        for m in reversed(messages):  # a partition's messages in offset order: the first one wins
            b = batches.get(self.shards.shard_of(m.partition()))
            if b is not None and b.lowest is not None and (m.topic(), m.partition()) in b.highest:
                b.lowest[m.topic(), m.partition()] = m.offset()
        for row in rows:
            batches[self.shards.shard_of(row[PARTITION_COLUMN])].rows.append(row)
        return [batches[shard] for shard in sorted(batches)]

    def _record(self, batches: list[Batch]) -> Recorded | None:
        """On the recorder thread: the batch recorded (``record_batch``), one transaction per
        shard holding that shard's partitions' events and positions; how many events were
        new, or None if the worker stopped while the ledger was unreachable. Home partitions
        are written only for each shard's ``unknown`` users (those this process has not
        seen committed there).

        The same statement moves the ledger's consumer positions past the batch, so the
        ledger's position and the events it covers commit or vanish together; a batch of
        undecodable messages only (already on the dead-letter topic) moves the positions
        alone. One shard: an outage is retried until it answers. Several: each shard's
        transaction is tried once, and one that fails is returned in ``failed`` (its
        partitions are paused and read again, :meth:`_settle`), so a shard down stops only
        its own users. A shard committed before another failed stays committed."""
        recorded, failed = 0, []
        for b in batches:
            positions = {PartitionKey(topic, partition): offset + 1 for (topic, partition), offset in b.highest.items()}

            def record(conn: psycopg.Connection[DictRow], b: Batch = b, positions=positions) -> int:
                with metrics.LEDGER_SECONDS.labels("record").time():
                    return ledger_events.record_batch(conn, b.rows, b.unknown, positions)

            if self.shards.single:
                try:
                    recorded += self._retrying("recording events", record, b.shard)
                except psycopg.OperationalError:
                    return None
                continue
            try:
                recorded += record(self._db(b.shard))
            except psycopg.OperationalError as exc:
                log.warning(
                    "recording events on ledger shard %d failed (unreachable?): its partitions pause: %s",
                    b.shard,
                    exc,
                    extra={"event": "shard_down"},
                )
                self.conns.pop(b.shard, None)
                failed.append(b)
        return Recorded(recorded, failed)

    def _settle(self) -> None:
        """Wait for the batch in flight; once it is committed, count it, store its offsets and
        wake the run loop. A recorder error other than an unreachable ledger is raised here."""
        if self.in_flight is None:
            return
        batch, self.in_flight = self.in_flight, None
        result = batch.recorded.result()
        recorded = None if result is None else result.new
        if batch.spans is not None:
            batch.spans.end(recorded)
        if result is None:
            # Stopping with the ledger down: nothing of this batch, or of any later one, is
            # stored, so all of it is read again next time.
            self.abandoned = True
            return
        # Every user of a committed batch has its users row now (inserted or already there;
        # rows are never deleted): later batches skip the upsert for them.
        assert recorded is not None
        highest = batch.highest
        if result.failed:
            highest = self._pause(result.failed, highest)
            for b in result.failed:
                batch.users.pop(b.shard, None)
        for shard, users in batch.users.items():
            known = self.known_users.setdefault(shard, set())
            if len(known) > KNOWN_USERS_MAX:
                known.clear()
            known.update(users)
        metrics.EVENTS_RECORDED.labels("new").inc(recorded)
        metrics.EVENTS_RECORDED.labels("duplicate").inc(batch.rows - recorded - sum(len(b.rows) for b in result.failed))
        self._store_offsets(highest)
        if recorded:
            self.loop.call_soon_threadsafe(self.runner.wake, self.settings.batch_window_s)

    def _pause(self, failed: list[Batch], highest: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """The failed shards' partitions paused and set back to their first offset not
        recorded; the offsets to store, theirs left out."""
        assert self.consumer is not None  # made before the poll loop starts
        probe_at = time.monotonic() + RETRY_S
        for b in failed:
            down = self.down.setdefault(b.shard, Down({}, probe_at))
            for (topic, partition), first in (b.lowest or {}).items():
                key = PartitionKey(topic, partition)
                if key in self.assigned:
                    down.seek.setdefault(key, first)
            paused = [TopicPartition(k.topic, k.partition) for k in down.seek]
            if paused:
                self.consumer.pause(paused)
            metrics.SHARD_UP.labels(str(b.shard)).set(0)
        gone = {tp for b in failed for tp in b.highest}
        return {tp: offset for tp, offset in highest.items() if tp not in gone}

    def _probe_down(self) -> None:
        """Ask each shard that is down, once its probe is due, for its partitions' positions; if
        it answers, read them again from there (the ledger's position, else the first offset not
        recorded) and resume them.

        The probe asks on the shard's recorder connection, so the batch in flight settles
        first, as the rebalance callbacks do: a probe's commit in the middle of the recorder's
        transaction committed its COPY, which empties the staging table, and the batch's
        statement then moved the ledger's position past events it never inserted (make chaos
        SEED=1 SHARDS=2: one acknowledged event lost as its shard came back)."""
        assert self.consumer is not None  # made before the poll loop starts
        now = time.monotonic()
        if not any(now >= down.probe_at for down in self.down.values()):
            return
        self._settle()
        for shard, down in list(self.down.items()):
            if now < down.probe_at:
                continue
            keys = [k for k in down.seek if k in self.assigned]
            try:
                positions = read_positions(self._db(shard), keys) if keys else {}
            except psycopg.OperationalError:
                self.conns.pop(shard, None)
                self.down[shard] = down._replace(probe_at=now + RETRY_S)
                continue
            del self.down[shard]
            if keys:
                self._seek_and_resume(keys, {k: positions.get(k, down.seek[k]) for k in keys})
            metrics.SHARD_UP.labels(str(shard)).set(1)
            log.info("ledger shard %d answers again: partitions %s resume", shard, sorted(k.partition for k in keys))

    def _seek_and_resume(self, keys: list[PartitionKey], offsets: dict[PartitionKey, int]) -> None:
        assert self.consumer is not None  # made before the poll loop starts
        parts = [TopicPartition(k.topic, k.partition, offsets[k]) for k in keys]
        for tp in parts:
            self.consumer.seek(tp)
        self.consumer.resume(parts)

    def _decode(self, messages: list) -> tuple[list[tuple], list[tuple], dict[tuple[str, int], int], Any]:
        """Staging rows of the decodable messages, ``(message, reason)`` of the others, the
        highest offset polled per partition, and (traces on) the events' record spans.

        Once per polled message, so kept to what the COPY needs: the codec hands back the
        event's fields in staging order, and the metrics are counted per batch.
        """
        rows: list[tuple[Any, ...]] = []
        bad: list[tuple[Any, ...]] = []
        highest: dict[tuple[str, int], int] = {}
        decode = self.codec.decode_row
        now = datetime.fromtimestamp(self.runner.clock.now(), UTC)  # the event window's, per batch
        spans = traces.RecordSpans(self.settings.events_topic) if tracing.enabled else None
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", error)
                continue
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            # A partition's messages arrive in offset order: the last one seen is the highest.
            highest[topic, partition] = offset
            try:
                row = (len(rows), *decode(message.value(), topic, now), topic, partition, offset)
            except DecodeError as exc:
                bad.append((message, exc.reason))
                continue
            rows.append(row if spans is None else spans.add(row, message.headers()))
        metrics.EVENTS_CONSUMED.inc(len(rows) + len(bad))
        return rows, bad, highest, spans

    def _store_offsets(self, highest: dict[tuple[str, int], int]) -> None:
        if self.abandoned:
            return
        offsets = [
            TopicPartition(topic, partition, offset + 1)
            for (topic, partition), offset in highest.items()
            if PartitionKey(topic, partition) in self.assigned
        ]
        if offsets:
            assert self.consumer is not None  # made before the poll loop starts
            try:
                self.consumer.store_offsets(offsets=offsets)
            except KafkaException as exc:
                # A partition revoked between poll and store: its new owner reads from the
                # last committed offset, and the ledger drops what we already recorded.
                log.info("offsets not stored (partition moved): %s", exc)


def _lag(info: dict) -> int:
    """A partition's lag from librdkafka's statistics: the end offset minus the committed one,
    or, while nothing is committed yet, minus this consumer's position. A partition assigned at
    the ledger's position (see on_assign) has no committed offset fetched until this worker
    commits one, which a quiet partition never makes it do; its lag is still known."""
    lag = info.get("consumer_lag", -1)
    if lag >= 0:
        return lag
    end = info.get("ls_offset", -1)
    end = end if end >= 0 else info.get("hi_offset", -1)
    position = info.get("app_offset", -1)
    position = position if position >= 0 else info.get("next_offset", -1)
    return max(end - position, 0) if end >= 0 and position >= 0 else -1


def _forget_lag(keys) -> None:
    """Drop the lag series of partitions this worker no longer holds: their new owner reports
    them, and a frozen last value here would read as lag nobody is working off."""
    for key in keys:
        try:
            metrics.CONSUMER_LAG.remove(str(key.partition))
        except KeyError:
            pass
