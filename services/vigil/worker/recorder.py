"""The recorder thread: a polled batch recorded in the ledger, one transaction per shard
(docs/worker.md, "Recording"; the commit order: :mod:`vigil.worker.consumer`, step 3).

:class:`Recorder` runs :func:`vigil.ledger.events.record_batch` on a thread of its own, so
the consumer thread polls and decodes the next batch meanwhile; one thread, so batches
commit in the order they were polled. With several ledger shards it splits a batch by the
shard of each partition (:meth:`Recorder.by_shard`), and a shard that fails is handed back
for the consumer to pause (:class:`vigil.worker.shard_outage.ShardOutages`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import psycopg
from psycopg.rows import DictRow

from vigil.ledger import events as ledger_events
from vigil.ledger.events import PARTITION_COLUMN
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics
from vigil.worker.shards import LedgerConnections, Shards

log = logging.getLogger(__name__)

Row = tuple[Any, ...]  # a staging row (vigil.ledger.events: n, the event's fields, topic, partition, offset)
# A polled confluent_kafka.Message: its stubs type every field Optional, where a polled
# message without an error has them all.
Message = Any


class Batch(NamedTuple):
    """What one shard's transaction records of a polled batch."""

    shard: int
    rows: list[Row]
    highest: dict[tuple[str, int], int]  # its partitions' highest offsets polled
    unknown: list[str]  # its users this process has not seen committed there
    lowest: dict[tuple[str, int], int] | None = None  # several shards: where to read again if it fails


class Recorded(NamedTuple):
    new: int  # events recorded (not duplicates)
    failed: list[Batch]  # several shards: the shards' batches that did not commit (their shard down)


class Recorder:
    """The recorder thread and its transactions: a polled batch, per shard, in the ledger."""

    def __init__(self, shards: Shards, conns: LedgerConnections) -> None:
        self.shards = shards  # where each partition's events and positions go
        self.conns = conns  # a connection per shard, shared with the rebalance callbacks
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder")

    def submit(self, batches: list[Batch]) -> Future[Recorded | None]:
        """Record ``batches`` on the recorder thread (:meth:`record`), after those before them."""
        return self._thread.submit(self.record, batches)

    def shutdown(self) -> None:
        self._thread.shutdown()

    def by_shard(self, rows: list[Row], highest: dict[tuple[str, int], int], messages: list[Message]) -> list[Batch]:
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

    def record(self, batches: list[Batch]) -> Recorded | None:
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
        partitions are paused and read again, :meth:`ConsumerLoop._settle`), so a shard down stops only
        its own users. A shard committed before another failed stays committed."""
        recorded, failed = 0, []
        for b in batches:
            positions = {PartitionKey(topic, partition): offset + 1 for (topic, partition), offset in b.highest.items()}

            def record(
                conn: psycopg.Connection[DictRow], b: Batch = b, positions: dict[PartitionKey, int] = positions
            ) -> int:
                with metrics.LEDGER_SECONDS.labels("record").time():
                    return ledger_events.record_batch(conn, b.rows, b.unknown, positions)

            if self.shards.single:
                try:
                    recorded += self.conns.retrying("recording events", record, b.shard)
                except psycopg.OperationalError:
                    return None
                continue
            try:
                recorded += record(self.conns.get(b.shard))
            except psycopg.OperationalError as exc:
                log.warning(
                    "recording events on ledger shard %d failed (unreachable?): its partitions pause: %s",
                    b.shard,
                    exc,
                    extra={"event": "shard_down"},
                )
                self.conns.drop(b.shard)
                failed.append(b)
        return Recorded(recorded, failed)
