"""The consumer's rebalance callbacks (run inside ``consume()``, on the consumer thread).

An assignment is a takeover in the ledger (:mod:`vigil.worker.fencing`), after the previous
owner's hand-over, before any claim is made for it. A partition still being handed over is
recorded at once and taken over later, by a thread of its own once the hand-over ends
(recording is not fenced: the dedup key and the GREATEST position make a late or repeated
batch harmless; claims are), so the consumer never waits for another worker's runs, and its
other partitions go on being recorded meanwhile. A revoke hands the partition's runs over
(they finish or are released in the background, the ledger holding the next takeover until
then: fencing rule 4), then commits the stored offsets synchronously; a *lost* partition
(session timed out) commits nothing, because another worker may already have committed past
us, and its runs' claims are given back in the background (a takeover may have come first).

Each callback settles the consumer's batch in flight first: they share its ledger
connections (:class:`vigil.worker.shards.LedgerConnections`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

import psycopg
from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition
from psycopg.rows import DictRow

from vigil.clock import Clock, utc
from vigil.ledger import partitions as ledger_partitions
from vigil.ledger.db import connect
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics
from vigil.worker.fencing import handing_over, take_over, wait_for_handover
from vigil.worker.settings import WorkerSettings
from vigil.worker.shard_outage import ShardOutages
from vigil.worker.shards import CATALOG, RETRY_S, LedgerConnections, Shards, read_positions

log = logging.getLogger(__name__)

# take_over's wait for a hand-over, when the caller knows none is in progress or has waited.
HANDOVER_WITHIN_NONE = 0.0


T = TypeVar("T")


def _partition(key: PartitionKey) -> int:
    return key.partition


class Claims(Protocol):
    """What a rebalance tells the run loop's claimer (:class:`vigil.worker.claim_loop.Claimer`)."""

    def assign(self, epochs: dict[PartitionKey, int]) -> Coroutine[Any, Any, None]: ...

    def hand_over(self, keys: list[PartitionKey], grace_s: float) -> Coroutine[Any, Any, None]: ...

    def revoke(
        self, keys: list[PartitionKey], release: bool = True, grace_s: float = 0.0
    ) -> Coroutine[Any, Any, None]: ...


class Rebalancer:
    """The callbacks ``on_assign``, ``on_revoke`` and ``on_lost``, and the takeovers that wait
    for a hand-over (:meth:`take_over_later`)."""

    def __init__(
        self,
        settings: WorkerSettings,
        claimer: Claims,
        loop: asyncio.AbstractEventLoop,
        stopping: threading.Event,
        clock: Clock | None,
        shards: Shards,
        conns: LedgerConnections,
        outages: ShardOutages,
        assigned: set[PartitionKey],
        settle: Callable[[], None],
        died: Callable[[BaseException], None],
    ) -> None:
        self.settings = settings
        self.claimer = claimer
        self.loop = loop
        self.stopping = stopping
        self.clock = clock  # the runner's: takeovers decide hand-overs and backoffs on it
        self.shards = shards
        self.conns = conns
        self.outages = outages
        self.assigned = assigned  # the consumer's: the partitions it holds
        self.settle = settle  # the consumer's batch in flight, settled before a connection is used
        self.died = died  # a takeover thread's death is the consumer loop's
        # Assigned partitions whose takeover waits for the previous owner's hand-over (a
        # thread each batch, :meth:`take_over_later`). The lock orders a takeover against a
        # revoke of the same partition: whichever comes second sees what the first did.
        self.taking_over: set[PartitionKey] = set()
        self._takeover_lock = threading.Lock()

    def _call_runner(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [PartitionKey(p.topic, p.partition) for p in partitions]
        if not keys:
            return
        self.settle()
        if not self.shards.single:  # a partition may have moved: the catalog's map again
            self.conns.retrying("reading the shard map", lambda _conn: self.shards.reload())
        later = self.conns.per_shard(
            "reading hand-overs", keys, lambda conn, some: handing_over(conn, some, self.clock)
        )
        now = [k for k in keys if k not in later]
        if now:
            epochs = self.conns.per_shard(
                "takeover", now, lambda conn, some: self._take_over(conn, some, HANDOVER_WITHIN_NONE)
            )
            self._call_runner(self.claimer.assign(epochs))
        self.assigned.update(keys)
        positions = self.conns.per_shard("reading consumer positions", keys, read_positions)
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
                threading.Thread(target=self.take_over_later, args=(some, shard), name="takeover", daemon=True).start()

    def _take_over(
        self, conn: psycopg.Connection[DictRow], keys: list[PartitionKey], within_s: float
    ) -> dict[PartitionKey, int]:
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

    def take_over_later(self, keys: list[PartitionKey], shard: int = CATALOG) -> None:
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
                        conn = connect(self.conns.dsn(shard))
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
                        self._call_runner(self.claimer.assign(epochs))
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
            self.died(exc)
            log.exception("takeover after a hand-over died", extra={"event": "loop_died"})
            self.stopping.set()
        finally:
            if conn is not None:
                conn.close()

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [PartitionKey(p.topic, p.partition) for p in partitions]
        self.settle()  # the batch in flight stores its offsets before they are committed
        # The partitions' runs get VIGIL_REVOKE_GRACE_S to finish, as a hand-over: this returns
        # once the ledger has its deadline, and recording goes on (only if the ledger cannot
        # take it does the grace pass here).
        grace_s = self.settings.revoke_grace_s
        self.forget_takeovers(keys)
        self.outages.forget(consumer, keys)
        self._call_runner(self.claimer.hand_over(keys, grace_s), timeout=grace_s + 60.0)
        try:
            consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                log.warning("offset commit on revoke failed: %s", exc)
        self.assigned.difference_update(keys)
        forget_lag(keys)

    def forget_takeovers(self, keys: list[PartitionKey]) -> None:
        """Revoked or lost before their takeover: never take them over (waits for one in
        progress, which then owns them, and the revoke hands them on)."""
        with self._takeover_lock:
            self.taking_over.difference_update(keys)
            metrics.AWAITING_TAKEOVER.set(len(self.taking_over))

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = [PartitionKey(p.topic, p.partition) for p in partitions]
        log.warning("partitions lost (session timed out): %s; committing nothing", [k.partition for k in keys])
        self.forget_takeovers(keys)
        self.outages.forget(consumer, keys)
        self._call_runner(self.claimer.revoke(keys, release=False))
        self.assigned.difference_update(keys)
        forget_lag(keys)


def forget_lag(keys: list[PartitionKey]) -> None:
    """Drop the lag series of partitions this worker no longer holds: their new owner reports
    them, and a frozen last value here would read as lag nobody is working off."""
    for key in keys:
        try:
            metrics.CONSUMER_LAG.remove(str(key.partition))
        except KeyError:
            pass
