"""The consumer thread's ledger connections: one per shard, synchronous (the consumer, its
recorder and its rebalance callbacks run on threads of their own, not on the run loop), and
retried through a ledger outage until the worker stops.

:mod:`vigil.worker.consumer` records on them, :mod:`vigil.worker.rebalance` takes partitions
over and reads their positions, :mod:`vigil.worker.shard_outage` probes a shard that is down.
The callers order their use: the rebalance callbacks settle the batch in flight before they
touch a connection the recorder holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import psycopg
from psycopg.rows import DictRow

from vigil.ledger import recovery as ledger_recovery
from vigil.ledger.db import connect
from vigil.ledger.events import prepare_record_connection
from vigil.ledger.partitions import PartitionKey
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import CATALOG, Shards

log = logging.getLogger("vigil.worker.consumer")  # the consumer thread's lines keep their logger

# The pause before a ledger statement that failed is tried again.
RETRY_S = 1.0

Conn = psycopg.Connection[DictRow]
T = TypeVar("T")
M = TypeVar("M")  # a dict or a set: answers per shard are merged with ``|``


def read_positions(conn: Conn, keys: list[PartitionKey]) -> dict[PartitionKey, int]:
    """The ledger's next offset for each of ``keys`` it has recorded from (read in its own transaction)."""
    positions = ledger_recovery.read_positions(conn, keys)
    conn.commit()
    return positions


def key_partition(key: PartitionKey) -> int:
    return key.partition


class LedgerConns:
    """A connection per ledger shard, opened when first used and again after it broke."""

    def __init__(self, settings: WorkerSettings, shards: Shards, stopping: threading.Event) -> None:
        self.settings = settings
        self.shards = shards
        self.stopping = stopping
        self.conns: dict[int, Conn] = {}

    def dsn(self, shard: int) -> str:
        return self.settings.dsn if shard == CATALOG else self.settings.shard_dsns[shard]

    def get(self, shard: int = CATALOG) -> Conn:
        conn = self.conns.get(shard)
        if conn is None or conn.closed or conn.broken:
            conn = self.conns[shard] = connect(self.dsn(shard))
            prepare_record_connection(conn)
        return conn

    def drop(self, shard: int) -> None:
        """Forget ``shard``'s connection (it failed): the next use opens another."""
        self.conns.pop(shard, None)

    def retrying(self, what: str, action: Callable[[Conn], T], shard: int = CATALOG) -> T:
        """``action(conn)`` on ``shard``'s connection until it succeeds or the worker stops
        (ledger outages); stopping raises the last psycopg.OperationalError."""
        while True:
            try:
                return action(self.get(shard))
            except psycopg.OperationalError as exc:
                log.warning("%s failed (ledger shard %d unreachable?), retrying: %s", what, shard, exc)
                self.drop(shard)
                if self.stopping.wait(RETRY_S):
                    raise

    def per_shard(self, what: str, keys: list[PartitionKey], action: Callable[[Conn, list[PartitionKey]], M]) -> M:
        """``action(conn, keys_of_shard)`` on each shard of ``keys`` (not empty), its own
        transaction there; their answers (dicts or sets) merged."""
        merged: Any = None
        for shard, some in self.shards.split(keys, key_partition).items():

            def on_shard(conn: Conn, some: list[PartitionKey] = some) -> M:
                return action(conn, some)

            answer = self.retrying(what, on_shard, shard)
            merged = answer if merged is None else merged | answer
        return cast(M, merged)

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
