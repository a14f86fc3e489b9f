"""Which ledger shard ingest writes a user's state to, and its pools there (issue 41).

What ingest reads or writes for one user (approval answers, task cancels, timers, the
session lookups of a message) goes to the shard of the user's home partition; what is global
(tokens, hooks, channels, the audit trail) stays on shard 0, the catalog, through the pool
ingest opens at start. The map and the pools are the ledger's (:mod:`vigil.ledger.shardpools`);
ingest's policy is when they are read and opened: one shard reads no map and opens nothing;
several read the map from the catalog on the first request that needs it (a catalog that does
not answer within :data:`MAP_CONNECT_TIMEOUT_S` makes that request a 503, and the next one
tries again, off the event loop), and open each other shard's pool on the first request for
one of its users.
"""

from __future__ import annotations

import asyncio

from vigil.ingest.settings import IngestSettings
from vigil.ledger import shardpools
from vigil.ledger.db import AsyncPool, Pool
from vigil.ledger.shardpools import ShardRoutes

# A catalog that does not answer in this long makes the request a 503, not a hang.
MAP_CONNECT_TIMEOUT_S = 5


def routes(settings: IngestSettings) -> ShardRoutes:
    """The map ingest routes by, read on first need."""
    return ShardRoutes(settings.shard_dsns, partitions=settings.partitions, connect_timeout=MAP_CONNECT_TIMEOUT_S)


class AsyncShardPools(shardpools.AsyncShardPools):
    """The pools of the request handlers on the event loop."""

    async def of_user(self, user_id: str) -> AsyncPool:
        """The user's shard's pool. Raises psycopg.OperationalError when the map is still to be
        read and the catalog does not answer."""
        if self.routes.loaded:
            shard = self.routes.shard_of_user(user_id)
        else:
            shard = await asyncio.to_thread(self.routes.shard_of_user, user_id)
        return await self.open(shard)

    async def close_others(self) -> None:
        """Close the pools this made (the catalog's is its opener's)."""
        await self.close(catalog=False)


class SyncShardPools(shardpools.SyncShardPools):
    """For ledger work on a worker thread (approvals)."""

    def of_user(self, user_id: str) -> Pool:
        return self.open(self.routes.shard_of_user(user_id))

    def every(self) -> list[Pool]:
        """Every shard's pool, in shard order (a request id names no user: it is looked up on each)."""
        return [self.open(shard) for shard in range(self.routes.count)]

    def close_others(self) -> None:
        self.close(catalog=False)
