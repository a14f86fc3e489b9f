"""The ledger's shards as the services reach them: the map (which shard holds a partition, a
user) and a pool per shard (issue 41; docs/architecture.md, "Shards and the catalog").

One module owns both, so the three routers keep only their own policy:

- the worker (``worker/shards.py``) reads the map at start and again at each assignment, and
  opens a shard's pool when a partition of it is first assigned;
- ingest (``ingest/shards.py``) reads the map on the first request that needs it and opens a
  shard's pool on the first request for one of its users;
- the operator commands and the console (``admin/shards.py``) read the map once per command
  and connect per command, without pools.

:class:`ShardRoutes` is the map half. One shard (or none named: a pool a test hands in)
decides nothing: every lookup answers :data:`CATALOG` without reading the map, so a ledger
without shards costs what it always did. Several: the catalog's ``shard_map`` is read on the
first lookup (or handed in, read already), and :meth:`ShardRoutes.reload` reads it again.

:class:`AsyncShardPools` and :class:`SyncShardPools` are the pool half: shard 0's pool is the
catalog's, opened by whoever made it; another shard's is made by ``make(dsn, shard)`` and
opened (without waiting for a connection: a shard that does not answer yet fails its
statements, not its opener) before anyone else is handed it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from vigil.ledger.db import AsyncPool, Pool
from vigil.ledger.shardmap import ShardMap
from vigil.ledger.shards import load_map
from vigil.partitioner import home_partition

P = TypeVar("P", AsyncPool, Pool)

# Shard 0: the catalog (global configuration), and the only shard of a ledger without shards.
CATALOG = 0


class ShardRoutes:
    """Which shard holds a partition or a user: the catalog's map, read when first needed."""

    def __init__(
        self,
        dsns: Sequence[str],
        *,
        partitions: int,
        shard_map: ShardMap | None = None,
        connect_timeout: int | None = None,
    ) -> None:
        self.dsns = tuple(dsns)
        self.partitions = partitions  # VIGIL_PARTITIONS: a user's home partition among them
        self.single = len(self.dsns) <= 1
        self.connect_timeout = connect_timeout
        self._map = shard_map
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return max(1, len(self.dsns))

    @property
    def loaded(self) -> bool:
        """Whether a lookup can answer without reading the catalog."""
        return self.single or self._map is not None

    def shard_map(self) -> ShardMap:
        """The catalog's map, read once (several shards). Raises psycopg.OperationalError when
        the catalog does not answer; the next call tries again."""
        if self._map is None:
            with self._lock:
                if self._map is None:
                    self._map = ShardMap(self.dsns) if self.single else self._read()
        return self._map

    def reload(self) -> None:
        """Read the catalog's map again (a partition may have moved). One shard reads nothing."""
        if not self.single:
            shard_map = self._read()
            with self._lock:
                self._map = shard_map

    def _read(self) -> ShardMap:
        return load_map(self.dsns, connect_timeout=self.connect_timeout)

    def shard_of(self, partition: int) -> int:
        return CATALOG if self.single else self.shard_map().shard_of(partition)

    def shard_of_user(self, user_id: str) -> int:
        """The shard of the user's home partition: where their state lives."""
        return CATALOG if self.single else self.shard_of(home_partition(user_id, self.partitions))


class _ShardPools(Generic[P]):
    def __init__(self, routes: ShardRoutes, catalog: P, make: Callable[[str, int], P] | None) -> None:
        self.routes = routes
        self._pools: dict[int, P] = {CATALOG: catalog}
        self._make: Callable[[str, int], P] | None = make

    @property
    def catalog(self) -> P:
        return self._pools[CATALOG]

    def get(self, shard: int) -> P | None:
        """The shard's pool if it was opened, else None."""
        return self._pools.get(shard)

    def opened(self) -> list[tuple[int, P]]:
        """Every shard with an open pool, the catalog's first."""
        return sorted(self._pools.items(), key=lambda item: item[0])

    def _made(self, shard: int) -> P:
        if self._make is None:
            raise ValueError(f"ledger shard {shard}: no way to make its pool was given")
        return self._make(self.routes.dsns[shard], shard)


class AsyncShardPools(_ShardPools[AsyncPool]):
    def __init__(
        self, routes: ShardRoutes, catalog: AsyncPool, make: Callable[[str, int], AsyncPool] | None = None
    ) -> None:
        super().__init__(routes, catalog, make)
        self._lock = asyncio.Lock()

    async def open(self, shard: int) -> AsyncPool:
        """The shard's pool, made and opened if it is not yet."""
        if (pool := self._pools.get(shard)) is not None:
            return pool
        async with self._lock:
            if shard not in self._pools:
                made = self._made(shard)
                await made.open(wait=False)
                self._pools[shard] = made
            return self._pools[shard]

    async def close(self, *, catalog: bool) -> None:
        """Close the pools this made, highest shard first, and the catalog's last if ``catalog``
        (its opener may close it itself)."""
        for shard, pool in reversed(self.opened()):
            if shard != CATALOG or catalog:
                await pool.close()


class SyncShardPools(_ShardPools[Pool]):
    """For ledger work on worker threads."""

    def __init__(self, routes: ShardRoutes, catalog: Pool, make: Callable[[str, int], Pool] | None = None) -> None:
        super().__init__(routes, catalog, make)
        self._lock = threading.Lock()

    def open(self, shard: int) -> Pool:
        """The shard's pool, made and opened if it is not yet."""
        if (pool := self._pools.get(shard)) is not None:
            return pool
        with self._lock:
            if shard not in self._pools:
                made = self._made(shard)
                made.open(wait=False)
                self._pools[shard] = made
            return self._pools[shard]

    def close(self, *, catalog: bool) -> None:
        """As :meth:`AsyncShardPools.close`."""
        for shard, pool in reversed(self.opened()):
            if shard != CATALOG or catalog:
                pool.close()
