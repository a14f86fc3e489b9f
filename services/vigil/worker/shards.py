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
  again to the user's home partition (:meth:`Shards.elsewhere`, the consumer's reroute).

No transaction spans two shards: callers split their work with :meth:`Shards.split` and run
one transaction per shard. One shard (the default) decides nothing: every lookup answers
shard 0 without reading the map, so today's hot path costs what it did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from vigil.errors import VigilError
from vigil.ledger.db import AsyncPool
from vigil.ledger.shardmap import ShardMap
from vigil.ledger.shardpools import CATALOG, AsyncShardPools, ShardRoutes
from vigil.partitioner import home_partition
from vigil.worker.task_door import LedgerTasks

T = TypeVar("T")

__all__ = ["CATALOG", "ShardNotOpen", "Shards"]

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
