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
   positions (:class:`vigil.worker.recorder.Recorder`); an event whose user's home
   partition is on another shard is produced again there first
   (:func:`vigil.worker.shards.reroute`), not recorded here.
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

Rebalances are :mod:`vigil.worker.rebalance`'s (an assignment is a takeover, a revoke a
hand-over); a ledger shard that is down pauses only its own partitions
(:mod:`vigil.worker.shard_outage`); an event read on another shard's partition is produced
again to its home (:func:`vigil.worker.shards.reroute`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from vigil import tracing
from vigil.bus import kafka as bus_kafka
from vigil.bus.codec import DecodeError, EventCodec
from vigil.bus.kafka import ProduceError
from vigil.clock import Clock
from vigil.ledger.db import AsyncPool
from vigil.ledger.events import PARTITION_COLUMN, USER_COLUMN
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics, traces
from vigil.worker.rebalance import Rebalancer
from vigil.worker.recorder import Batch, Message, Recorded, Recorder, Row
from vigil.worker.settings import WorkerSettings
from vigil.worker.shard_outage import ShardOutages
from vigil.worker.shards import CATALOG, RETRY_S, LedgerConnections, Shards, reroute

if TYPE_CHECKING:  # the worker's wiring (main.py) hands them in
    from vigil.worker.deadletters import DeadLetters
    from vigil.worker.runner import Runner

log = logging.getLogger(__name__)


def consumer_config(settings: WorkerSettings, on_stats: Any) -> dict[str, Any]:
    """The worker's group member (:func:`vigil.bus.kafka.consumer_config`): its offsets stored
    by hand, after the ledger commit (step 4 above)."""
    return bus_kafka.consumer_config(
        settings,
        group=settings.worker_group,
        session_timeout_ms=settings.kafka_session_timeout_ms,
        max_poll_interval_ms=settings.kafka_max_poll_interval_ms,
        on_stats=on_stats,
    )


# How long an idle poll waits for the next message. A poll never waits for a *full* batch:
# consume(n, timeout) returns only when n messages came or the timeout passed, which at a
# moderate rate held every event back by up to the whole timeout before it was recorded.
IDLE_POLL_S = 0.2


# Bound of the known-users set (about 100 bytes each); past it the set starts over.
KNOWN_USERS_MAX = 500_000


class InFlight(NamedTuple):
    """A batch handed to the recorder thread and not yet settled."""

    recorded: Future[Recorded | None]  # Recorded, or None if the worker stopped before the ledger answered
    highest: dict[tuple[str, int], int]  # the offsets to store once it is committed
    rows: int
    users: dict[int, set[str]]  # per shard, whose users row exists there once it is committed
    spans: traces.RecordSpans | None = None  # traces on: the events' record spans, ended at the commit


class ConsumerLoop(threading.Thread):
    def __init__(
        self,
        settings: WorkerSettings,
        runner: Runner,
        loop: asyncio.AbstractEventLoop,
        dead_letters: DeadLetters,
        stopping: threading.Event,
        clock: Clock | None = None,
        shards: Shards | None = None,
    ) -> None:
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
        self.conns = LedgerConnections(settings, self.shards, stopping)
        self.consumer: Consumer | None = None
        self.assigned: set[PartitionKey] = set()
        self.error: BaseException | None = None
        # The recorder: one thread, so batches commit in the order they were polled. It and
        # the rebalance callbacks share self.conns; the callbacks settle the batch in flight
        # before they touch it.
        self.recorder = Recorder(self.shards, self.conns)
        # Users whose users row (home partition) a committed batch of ours has seen, per shard:
        # the upsert of home partitions cost each batch an index probe per event for nothing.
        self.known_users: dict[int, set[str]] = {}
        self.in_flight: InFlight | None = None
        self.abandoned = False  # a batch was given up (stopping with the ledger down): store no more offsets
        # Several shards: those that did not take a batch, their partitions paused meanwhile
        # (one shard: its outage is the worker's, retried in place as ever).
        self.outages = ShardOutages(self.conns, self.assigned)
        self.rebalance = Rebalancer(
            settings,
            runner.claimer,
            loop,
            stopping,
            clock,
            self.shards,
            self.conns,
            self.outages,
            self.assigned,
            settle=self._settle,
            died=self._died,
        )

    # -- rebalances (:mod:`vigil.worker.rebalance`, inside consume(), on this thread) -----

    def _died(self, exc: BaseException) -> None:
        """A thread of the consumer's (a takeover after a hand-over) died: as the loop's own death."""
        self.error = exc
        self.stopping.set()

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
        rebalance = self.rebalance
        self.consumer.subscribe(
            [self.settings.events_topic],
            on_assign=rebalance.on_assign,
            on_revoke=rebalance.on_revoke,
            on_lost=rebalance.on_lost,
        )
        try:
            while not self.stopping.is_set():
                messages = self._poll()
                if messages:
                    self._handle(messages)
                if self.outages:
                    self._probe_down()
        finally:
            try:
                self._settle()
            finally:
                # close() revokes the assignment (our on_revoke releases runs and commits).
                self.consumer.close()
                self.recorder.shutdown()
                self.conns.close()

    def _poll(self) -> list[Message]:
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

    def _handle(self, messages: list[Message]) -> None:
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
            kept = reroute(rows, messages, self.shards, self.dead_letters.producer, self.settings, self.stopping)
            if kept is None:
                return
            rows = kept
        self._settle()
        if self.outages:  # polled before their shard's pause took effect: read again on resume
            paused = self.outages.paused()
            rows = [r for r in rows if (r[PARTITION_COLUMN - 1], r[PARTITION_COLUMN]) not in paused]
            highest = {tp: offset for tp, offset in highest.items() if tp not in paused}
        if highest:
            if self.shards.single:
                batches = [Batch(CATALOG, rows, highest, [])]
            else:
                batches = self.recorder.by_shard(rows, highest, messages)
            users: dict[int, set[str]] = {}
            for b in batches:
                users[b.shard] = {row[USER_COLUMN] for row in b.rows}
                b.unknown.extend(sorted(users[b.shard] - self.known_users.get(b.shard, set())))
            self.in_flight = InFlight(self.recorder.submit(batches), highest, len(rows), users, spans)

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
            assert self.consumer is not None  # made before the poll loop starts
            highest = self.outages.pause(self.consumer, result.failed, highest)
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

    def _probe_down(self) -> None:
        """A down shard's probe, once due (:meth:`ShardOutages.probe`). It asks on the shard's
        recorder connection, so the batch in flight settles first, as the rebalance callbacks
        do: a probe's commit in the middle of the recorder's transaction committed its COPY,
        which empties the staging table, and the batch's statement then moved the ledger's
        position past events it never inserted (make chaos SEED=1 SHARDS=2: one acknowledged
        event lost as its shard came back)."""
        assert self.consumer is not None  # made before the poll loop starts
        if not self.outages.due():
            return
        self._settle()
        self.outages.probe(self.consumer)

    def _decode(
        self, messages: list[Message]
    ) -> tuple[list[Row], list[tuple[Message, str]], dict[tuple[str, int], int], Any]:
        """Staging rows of the decodable messages, ``(message, reason)`` of the others, the
        highest offset polled per partition, and (traces on) the events' record spans.

        Once per polled message, so kept to what the COPY needs: the codec hands back the
        event's fields in staging order, and the metrics are counted per batch.
        """
        rows: list[Row] = []
        bad: list[tuple[Message, str]] = []
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


def _lag(info: dict[str, Any]) -> int:
    """A partition's lag from librdkafka's statistics: the end offset minus the committed one,
    or, while nothing is committed yet, minus this consumer's position. A partition assigned at
    the ledger's position (see on_assign) has no committed offset fetched until this worker
    commits one, which a quiet partition never makes it do; its lag is still known."""
    lag = info.get("consumer_lag", -1)
    if lag >= 0:
        return int(lag)
    end = info.get("ls_offset", -1)
    end = end if end >= 0 else info.get("hi_offset", -1)
    position = info.get("app_offset", -1)
    position = position if position >= 0 else info.get("next_offset", -1)
    return max(end - position, 0) if end >= 0 and position >= 0 else -1
