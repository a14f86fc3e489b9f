"""Several ledger shards: one that does not take its batch stops only its own partitions.

Its partitions are paused and set back to their first offset not recorded; the other shards'
partitions go on. Once a second has passed the shard is asked for its partitions' positions;
when it answers they are read again from there (the ledger's position, else the first offset
not recorded) and resumed. With one shard an outage is the worker's: the consumer retries it
in place (:meth:`vigil.worker.ledger_conns.LedgerConns.retrying`) and never comes here.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import psycopg
from confluent_kafka import Consumer, TopicPartition

from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics
from vigil.worker.ledger_conns import RETRY_S, LedgerConns, read_positions
from vigil.worker.reroute import PARTITION_COLUMN, TOPIC_COLUMN, Batch, Offsets, Row

log = logging.getLogger("vigil.worker.consumer")  # the consumer thread's lines keep their logger


class Down(NamedTuple):
    """A shard that did not take its batch. Its partitions are paused, to be read again from
    ``seek`` once it answers."""

    seek: dict[PartitionKey, int]  # each paused partition's first offset not recorded
    probe_at: float  # monotonic: when to ask the shard again


class ShardOutages:
    """The shards that are down and their paused partitions (of ``assigned``, the partitions held)."""

    def __init__(self, ledger: LedgerConns, assigned: set[PartitionKey]) -> None:
        self.ledger = ledger
        self.assigned = assigned
        self.down: dict[int, Down] = {}

    def skip_paused(self, rows: list[Row], highest: Offsets) -> tuple[list[Row], Offsets]:
        """Polled before their shard's pause took effect: left out, read again on resume."""
        if not self.down:
            return rows, highest
        paused = {(k.topic, k.partition) for d in self.down.values() for k in d.seek}
        rows = [r for r in rows if (r[TOPIC_COLUMN], r[PARTITION_COLUMN]) not in paused]
        highest = {tp: offset for tp, offset in highest.items() if tp not in paused}
        return rows, highest

    def pause(self, consumer: Consumer, failed: list[Batch], highest: Offsets) -> Offsets:
        """The failed shards' partitions paused and set back to their first offset not
        recorded; the offsets to store, theirs left out."""
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

    def probe(self, consumer: Consumer) -> None:
        """Ask each shard that is down, once its probe is due, for its partitions' positions; if
        it answers, read them again from there (the ledger's position, else the first offset not
        recorded) and resume them."""
        now = time.monotonic()
        for shard, down in list(self.down.items()):
            if now < down.probe_at:
                continue
            keys = [k for k in down.seek if k in self.assigned]
            try:
                positions = read_positions(self.ledger.get(shard), keys) if keys else {}
            except psycopg.OperationalError:
                self.ledger.drop(shard)
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
        """Revoked or lost while paused for their shard: resumed as they go (a later owner reads
        them from the ledger's position); the shard is still probed, to report it up again."""
        gone = [k for down in self.down.values() for k in down.seek if k in keys]
        for down in self.down.values():
            for k in gone:
                down.seek.pop(k, None)
        if gone:
            consumer.resume([TopicPartition(k.topic, k.partition) for k in gone])
