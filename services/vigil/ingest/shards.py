"""Which ledger shard ingest writes a user's state to, and its pools there (issue 41).

What ingest reads or writes for one user (approval answers, task cancels, timers, the
session lookups of a message) goes to the shard of the user's home partition
(:meth:`vigil.ledger.shardmap.ShardMap.shard_of_user`); what is global (tokens, hooks,
channels, the audit trail) stays on shard 0, the catalog, through the pool ingest opens at
start. One shard: every user is on that pool, and nothing here reads the map or opens
anything. Several: the map is read from the catalog once, on the first request that needs it
(a catalog that does not answer then is a 503, and the next request tries again), and each
other shard's pool is made and opened on the first request for one of its users.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from vigil.ingest.settings import IngestSettings
from vigil.ledger.db import AsyncPool, Pool
from vigil.ledger.shardmap import ShardMap
from vigil.ledger.shards import load_map

P = TypeVar("P", AsyncPool, Pool)

# A catalog that does not answer in this long makes the request a 503, not a hang.
MAP_CONNECT_TIMEOUT_S = 5


class ShardRouter:
    """The shard of each user, from the map read once from the catalog."""

    def __init__(self, settings: IngestSettings):
        self.dsns = settings.shard_dsns
        self.partitions = settings.partitions
        self._map: ShardMap | None = ShardMap(self.dsns) if len(self.dsns) == 1 else None
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self.dsns)

    def shard_of_user(self, user_id: str) -> int:
        """Blocks on the catalog the first time (several shards): raises psycopg.OperationalError
        when it does not answer."""
        if self._map is None:
            with self._lock:
                if self._map is None:
                    self._map = load_map(self.dsns, connect_timeout=MAP_CONNECT_TIMEOUT_S)
        return self._map.shard_of_user(user_id, partitions=self.partitions)

    async def shard_of_user_async(self, user_id: str) -> int:
        if self._map is not None:
            return self._map.shard_of_user(user_id, partitions=self.partitions)
        return await asyncio.to_thread(self.shard_of_user, user_id)


class ShardPools(Generic[P]):
    """A pool per shard: shard 0's is the catalog's (opened by the caller); another shard's is
    made by ``make(dsn, shard)`` and opened on first use, before anyone else is handed it."""

    def __init__(self, router: ShardRouter, catalog: P, make: Callable[[str, int], P]):
        self.router = router
        self._pools: dict[int, P] = {0: catalog}
        self._make: Callable[[str, int], P] = make

    def made(self) -> list[P]:
        """The pools made so far, the catalog's first."""
        return [self._pools[shard] for shard in sorted(self._pools)]


class AsyncShardPools(ShardPools[AsyncPool]):
    def __init__(self, router: ShardRouter, catalog: AsyncPool, make: Callable[[str, int], AsyncPool]):
        super().__init__(router, catalog, make)
        self._lock = asyncio.Lock()

    async def of_shard(self, shard: int) -> AsyncPool:
        if (pool := self._pools.get(shard)) is not None:
            return pool
        async with self._lock:
            if shard not in self._pools:
                made = self._make(self.router.dsns[shard], shard)
                await made.open(wait=False)
                self._pools[shard] = made
            return self._pools[shard]

    async def of_user(self, user_id: str) -> AsyncPool:
        return await self.of_shard(await self.router.shard_of_user_async(user_id))

    async def close_others(self) -> None:
        """Close the pools this made (the catalog's is its opener's)."""
        for pool in self.made()[1:]:
            await pool.close()


class SyncShardPools(ShardPools[Pool]):
    """For ledger work on a worker thread (approvals)."""

    def __init__(self, router: ShardRouter, catalog: Pool, make: Callable[[str, int], Pool]):
        super().__init__(router, catalog, make)
        self._lock = threading.Lock()

    def of_shard(self, shard: int) -> Pool:
        if (pool := self._pools.get(shard)) is not None:
            return pool
        with self._lock:
            if shard not in self._pools:
                made = self._make(self.router.dsns[shard], shard)
                made.open(wait=False)
                self._pools[shard] = made
            return self._pools[shard]

    def of_user(self, user_id: str) -> Pool:
        return self.of_shard(self.router.shard_of_user(user_id))

    def every(self) -> list[Pool]:
        """Every shard's pool, in shard order (a request id names no user: it is looked up on each)."""
        return [self.of_shard(shard) for shard in range(self.router.count)]

    def close_others(self) -> None:
        for pool in self.made()[1:]:
            pool.close()
