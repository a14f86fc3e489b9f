"""Where the worker's ledger work goes when the ledger has several shards (issue 41;
docs/architecture.md, "Shards and the catalog").

One place decides it: :class:`Shards`, over the ledger's map and pools
(:mod:`vigil.ledger.shardpools`), with the worker's own policy: the catalog's pool (shard 0,
``VIGIL_DATABASE_URL``: profiles, policies, the model fleet) and a pool per other shard this
worker holds partitions on, opened when a partition of it is first assigned (a shard it holds
none of has no pool: :class:`ShardNotOpen`); the map read at start and again at each
assignment. Everything per user goes to the shard of a partition:

- recording, consumer positions, takeover, hand-over, heal, claims: the shard of the
  partition they are about (:meth:`Shards.shard_of`);
- a run's journal, sessions, memory, finish: the shard of its claim's home partition (where
  the claim was made), :meth:`Shards.pool_of`;
- a background task: the shard it was claimed from;
- the agent's read of a user's spending: the user's shard (:meth:`Shards.pool_of_user`);
- an event read on a partition of another shard than its user's: not recorded, produced
  again to the user's home partition (:meth:`Shards.elsewhere`, :func:`reroute`).

The consumer thread has its own synchronous connection per shard (:class:`LedgerConnections`):
recording, consumer positions, takeovers, outage probes.

No transaction spans two shards: callers split their work with :meth:`Shards.split` and run
one transaction per shard. One shard (the default) decides nothing: every lookup answers
shard 0 without reading the map, so today's hot path costs what it did.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import psycopg
from psycopg.rows import DictRow

from vigil.bus.kafka import EventProducer, ProduceError
from vigil.errors import VigilError
from vigil.ledger import recovery as ledger_recovery
from vigil.ledger.db import AsyncPool, connect
from vigil.ledger.events import PARTITION_COLUMN, USER_COLUMN, prepare_record_connection
from vigil.ledger.partitions import PartitionKey
from vigil.ledger.shardmap import ShardMap
from vigil.ledger.shardpools import CATALOG, AsyncShardPools, ShardRoutes
from vigil.partitioner import home_partition
from vigil.worker import metrics
from vigil.worker.settings import WorkerSettings
from vigil.worker.task_door import LedgerTasks

T = TypeVar("T")

__all__ = ["CATALOG", "LedgerConnections", "ShardNotOpen", "Shards", "read_positions", "reroute"]

log = logging.getLogger(__name__)

RETRY_S = 1.0  # a ledger shard or a broker that did not answer is asked again after this

# Reading the catalog's map (at start, at an assignment) waits this long for a connection.
MAP_CONNECT_TIMEOUT_S = 30


class ShardNotOpen(VigilError):
    """Ledger work for a shard this worker holds no partition of (no pool opened for it)."""


class Shards:
    """The worker's pools per ledger shard and the map that routes to them."""

    def __init__(
        self,
        catalog: AsyncPool,
        shard_map: ShardMap | None = None,
        *,
        make_pool: Callable[[str, int], AsyncPool] | None = None,
        partitions: int = 1,
    ) -> None:
        self.routes = ShardRoutes(
            shard_map.dsns if shard_map is not None else (),
            partitions=partitions,
            shard_map=shard_map,
            connect_timeout=MAP_CONNECT_TIMEOUT_S,
        )
        self.pools = AsyncShardPools(self.routes, catalog, make_pool)
        self.single = self.routes.single
        self.catalog = catalog
        self._doors: dict[int, LedgerTasks] = {}

    @classmethod
    def of(cls, source: Shards | AsyncPool) -> Shards:
        """``source`` itself, or a single shard over a pool (tests build the parts on one pool)."""
        return source if isinstance(source, Shards) else cls(source)

    # -- the map ------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return self.routes.count

    @property
    def partitions(self) -> int:
        return self.routes.partitions

    def reload(self) -> None:
        """Read the catalog's map again (an assignment: a partition may have moved). One
        shard reads nothing. Raises psycopg.OperationalError when the catalog does not answer."""
        self.routes.reload()

    def shard_of(self, partition: int) -> int:
        return self.routes.shard_of(partition)

    def elsewhere(self, user_id: str, partition: int, *, partitions: int) -> int | None:
        """The user's home partition (among ``partitions``, VIGIL_PARTITIONS) when its shard is
        not ``partition``'s: an event read there belongs to another shard and is produced
        again to that partition instead of recorded here. None when it is recorded here
        (always, on one shard)."""
        if self.single:
            return None
        home = home_partition(user_id, partitions)
        return None if self.shard_of(home) == self.shard_of(partition) else home

    def split(self, items: Iterable[T], partition: Callable[[T], int]) -> dict[int, list[T]]:
        """``items`` by shard (``partition(item)`` its partition), in their order."""
        if self.single:
            return {CATALOG: list(items)}
        by: dict[int, list[T]] = {}
        for item in items:
            by.setdefault(self.shard_of(partition(item)), []).append(item)
        return by

    # -- the pools ------------------------------------------------------------------------------

    async def open(self, partitions: Iterable[int]) -> None:
        """Open the pools of the shards of ``partitions`` that are not open yet."""
        if self.single:
            return
        for shard in sorted({self.shard_of(p) for p in partitions}):
            await self.pools.open(shard)

    def pool(self, shard: int) -> AsyncPool:
        pool = self.pools.get(shard)
        if pool is None:
            raise ShardNotOpen(f"ledger shard {shard}: no partition of it was assigned to this worker")
        return pool

    def pool_of(self, partition: int) -> AsyncPool:
        """The pool of the shard holding ``partition`` (a claim's home: where its run's ledger work goes)."""
        return self.catalog if self.single else self.pool(self.shard_of(partition))

    def task_door(self, shard: int) -> LedgerTasks:
        """The tasks a run or a background task of ``shard`` sees and records its children in."""
        door = self._doors.get(shard)
        if door is None:
            pool = self.pool(shard)
            door = self._doors[shard] = LedgerTasks(lambda: pool.connection())
        return door

    def pool_of_user(self, user_id: str) -> AsyncPool:
        """The pool of the user's shard (their home partition's): the agent's reads of their
        spending. A run's own work goes by its claim (:meth:`pool_of`), which is the same
        shard once every event is recorded at its user's home (:meth:`elsewhere`)."""
        return self.catalog if self.single else self.pool(self.routes.shard_of_user(user_id))

    def opened(self) -> list[tuple[int, AsyncPool]]:
        """Every shard with an open pool (the catalog's first): where background tasks are claimed."""
        return self.pools.opened()

    async def close(self) -> None:
        """Close the shards' pools, the catalog's last."""
        await self.pools.close(catalog=True)


def _partition(key: PartitionKey) -> int:
    return key.partition


def read_positions(conn: psycopg.Connection[DictRow], keys: list[PartitionKey]) -> dict[PartitionKey, int]:
    """The ledger's next offset for each of ``keys`` it has recorded from (read in its own transaction)."""
    positions = ledger_recovery.read_positions(conn, keys)
    conn.commit()
    return positions


class LedgerConnections:
    """The consumer thread's own connection per ledger shard: the recorder's batches, the
    rebalance callbacks' takeovers and positions, the outage probes. One user at a time: the
    callbacks and the probe settle the batch in flight before they use a connection."""

    def __init__(self, settings: WorkerSettings, shards: Shards, stopping: threading.Event) -> None:
        self.settings = settings
        self.shards = shards
        self.stopping = stopping
        self.conns: dict[int, psycopg.Connection[DictRow]] = {}

    def dsn(self, shard: int) -> str:
        return self.settings.dsn if shard == CATALOG else self.settings.shard_dsns[shard]

    def get(self, shard: int = CATALOG) -> psycopg.Connection[DictRow]:
        conn = self.conns.get(shard)
        if conn is None or conn.closed or conn.broken:
            conn = self.conns[shard] = connect(self.dsn(shard))
            prepare_record_connection(conn)
        return conn

    def drop(self, shard: int) -> None:
        """Forget ``shard``'s connection (it failed): the next use connects again."""
        self.conns.pop(shard, None)

    def retrying(self, what: str, action: Callable[[psycopg.Connection[DictRow]], T], shard: int = CATALOG) -> T:
        """``action(conn)`` on ``shard``'s connection until it succeeds or the worker stops
        (ledger outages; then the last error is raised)."""
        while True:
            try:
                return action(self.get(shard))
            except psycopg.OperationalError as exc:
                log.warning("%s failed (ledger shard %d unreachable?), retrying: %s", what, shard, exc)
                self.drop(shard)
                if self.stopping.wait(RETRY_S):
                    raise

    def per_shard(self, what: str, keys: list[PartitionKey], action: Callable[..., Any]) -> Any:
        """``action(conn, keys_of_shard)`` on each shard of ``keys``, its own transaction
        there; their answers (dicts or sets) merged."""
        merged: Any = None
        for shard, some in self.shards.split(keys, _partition).items():

            def on_shard(conn: psycopg.Connection[DictRow], some: list[PartitionKey] = some) -> Any:
                return action(conn, some)

            answer = self.retrying(what, on_shard, shard)
            merged = answer if merged is None else merged | answer
        return merged

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


def reroute(
    rows: list[tuple[Any, ...]],
    messages: list[Any],
    shards: Shards,
    producer: EventProducer,
    settings: WorkerSettings,
    stopping: threading.Event,
) -> list[tuple[Any, ...]] | None:
    """Several shards: the staging rows to record here; those whose user's home partition is
    on another shard (a producer with another partitioner, a topic grown past
    VIGIL_PARTITIONS) are produced again, verbatim, to that partition and acknowledged first,
    so their offsets are stored only after that (a crash in between produces them again: the
    home shard's dedup key drops the copy). None: the worker stopped first."""
    kept: list[tuple[Any, ...]] = []
    away: dict[int, list[tuple[Any, ...]]] = {}
    for row in rows:
        home = shards.elsewhere(row[USER_COLUMN], row[PARTITION_COLUMN], partitions=settings.partitions)
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
                producer.send_raw(copies, settings.events_topic, partition=home)
                break
            except ProduceError as exc:
                log.warning("producing events again to their home partition failed, retrying: %s", exc)
                if stopping.wait(RETRY_S):
                    return None
        metrics.EVENTS_REROUTED.inc(len(foreign))
        log.info(
            "%d event(s) read on partition(s) of another shard produced again to their home partition %d",
            len(foreign),
            home,
        )
    return kept
