"""Several ledger shards: one that did not take its batch stops only its own partitions.

The recorder tries each shard's transaction once (:mod:`vigil.worker.consumer`); a shard
that fails is *down*: its partitions are paused at their first offset not recorded, and
the other shards' partitions go on. Once a second has passed, the consumer thread asks the
shard again (:meth:`ShardOutages.probe`) for its partitions' positions; if it answers, they
are read again from there (the ledger's position, else the first offset not recorded) and
resumed. A partition revoked or lost while paused is resumed as it goes (a later owner
reads it from the ledger's position), and the shard is still probed, to report it up.

One shard: its outage is the worker's, retried in place (:class:`LedgerConnections.retrying`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import psycopg
from confluent_kafka import Consumer, TopicPartition

from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics
from vigil.worker.shards import RETRY_S, LedgerConnections, read_positions

log = logging.getLogger(__name__)


class Down(NamedTuple):
    """A shard that did not take its batch. Its partitions are paused, to be read again from
    ``seek`` once it answers; the other shards' partitions go on."""

    seek: dict[PartitionKey, int]  # each paused partition's first offset not recorded
    probe_at: float  # monotonic: when to ask the shard again


class ShardOutages:
    """The shards that are down, their paused partitions, and the probes that end them."""

    def __init__(self, conns: LedgerConnections, assigned: set[PartitionKey]) -> None:
        self.conns = conns
        self.assigned = assigned  # the consumer's: only partitions still held are paused or resumed
        self.down: dict[int, Down] = {}

    def __bool__(self) -> bool:
        return bool(self.down)

    def paused(self) -> set[tuple[str, int]]:
        """The (topic, partition) of every paused partition."""
        return {(k.topic, k.partition) for d in self.down.values() for k in d.seek}

    def pause(
        self, consumer: Consumer, failed: list[Any], highest: dict[tuple[str, int], int]
    ) -> dict[tuple[str, int], int]:
        """The shards of ``failed`` (the consumer's batches that did not commit) down: their
        partitions paused and set back to their first offset not recorded. Returns the
        offsets of ``highest`` to store, theirs left out."""
        probe_at = time.monotonic() + RETRY_S
        for b in failed:
            down = self.down.setdefault(b.shard, Down({}, probe_at))
            for (topic, partition), first in (b.lowest or {}).items():
                key = PartitionKey(topic, partition)
                if key in self.assigned:
                    down.seek.setdefault(key, first)
            paused = [TopicPartition(k.topic, k.partition) for k in down.seek]
            if paused:
                consumer.pause(paused)
            metrics.SHARD_UP.labels(str(b.shard)).set(0)
        gone = {tp for b in failed for tp in b.highest}
        return {tp: offset for tp, offset in highest.items() if tp not in gone}

    def due(self) -> bool:
        """Whether a down shard's probe is due."""
        now = time.monotonic()
        return any(now >= down.probe_at for down in self.down.values())

    def probe(self, consumer: Consumer) -> None:
        """Ask each shard whose probe is due for its partitions' positions, on its recorder
        connection (the caller has settled the batch in flight on it); if it answers, its
        partitions are read again from there and resumed."""
        now = time.monotonic()
        for shard, down in list(self.down.items()):
            if now < down.probe_at:
                continue
            keys = [k for k in down.seek if k in self.assigned]
            try:
                positions = read_positions(self.conns.get(shard), keys) if keys else {}
            except psycopg.OperationalError:
                self.conns.drop(shard)
                self.down[shard] = down._replace(probe_at=now + RETRY_S)
                continue
            del self.down[shard]
            if keys:
                parts = [TopicPartition(k.topic, k.partition, positions.get(k, down.seek[k])) for k in keys]
                for tp in parts:
                    consumer.seek(tp)
                consumer.resume(parts)
            metrics.SHARD_UP.labels(str(shard)).set(1)
            log.info("ledger shard %d answers again: partitions %s resume", shard, sorted(k.partition for k in keys))

    def forget(self, consumer: Consumer, keys: list[PartitionKey]) -> None:
        """``keys`` revoked or lost while paused: resumed as they go (a later owner reads them
        from the ledger's position); their shard is still probed, to report it up again."""
        gone = [k for down in self.down.values() for k in down.seek if k in keys]
        for down in self.down.values():
            for k in gone:
                down.seek.pop(k, None)
        if gone:
            consumer.resume([TopicPartition(k.topic, k.partition) for k in gone])
