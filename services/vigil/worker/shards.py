"""Where the worker's ledger work goes when the ledger has several shards (issue 41;
docs/architecture.md, "Shards and the catalog").

One place decides it: :class:`Shards` holds the catalog's pool (shard 0,
``VIGIL_DATABASE_URL``: profiles, policies, the model fleet) and a pool per other shard this
worker holds partitions on, opened when a partition of it is first assigned. Everything per
user goes to the shard of a partition:

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
from vigil.ledger.shards import load_map
from vigil.partitioner import home_partition
from vigil.worker.task_door import LedgerTasks

T = TypeVar("T")

CATALOG = 0


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
        self.map = shard_map
        self.partitions = partitions  # VIGIL_PARTITIONS: a user's home partition among them
        self.single = shard_map is None or shard_map.count == 1
        self.catalog = catalog
        self._pools: dict[int, AsyncPool] = {CATALOG: catalog}
        self._doors: dict[int, LedgerTasks] = {}
        self._make_pool = make_pool

    @classmethod
    def of(cls, source: Shards | AsyncPool) -> Shards:
        """``source`` itself, or a single shard over a pool (tests build the parts on one pool)."""
        return source if isinstance(source, Shards) else cls(source)

    # -- the map ------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return 1 if self.map is None else self.map.count

    def reload(self) -> None:
        """Read the catalog's map again (an assignment: a partition may have moved). One
        shard reads nothing. Raises psycopg.OperationalError when the catalog does not answer."""
        if not self.single:
            assert self.map is not None
            self.map = load_map(self.map.dsns)

    def shard_of(self, partition: int) -> int:
        if self.single:
            return CATALOG
        assert self.map is not None
        return self.map.shard_of(partition)

    def elsewhere(self, user_id: str, partition: int, *, partitions: int) -> int | None:
        """The user's home partition (among ``partitions``, VIGIL_PARTITIONS) when its shard is
        not ``partition``'s: an event read there belongs to another shard and is produced
        again to that partition instead of recorded here. None when it is recorded here
        (always, on one shard)."""
        if self.single:
            return None
        assert self.map is not None
        home = home_partition(user_id, partitions)
        return None if self.map.shard_of(home) == self.map.shard_of(partition) else home

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
        for shard in sorted({self.shard_of(p) for p in partitions} - set(self._pools)):
            assert self._make_pool is not None and self.map is not None
            pool = self._make_pool(self.map.dsns[shard], shard)
            # Not waiting for its first connections: a shard that does not answer yet fails
            # its statements, which are retried, rather than the assignment.
            await pool.open(wait=False)
            self._pools[shard] = pool

    def pool(self, shard: int) -> AsyncPool:
        try:
            return self._pools[shard]
        except KeyError:
            raise ShardNotOpen(f"ledger shard {shard}: no partition of it was assigned to this worker") from None

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
        if self.single:
            return self.catalog
        return self.pool(self.shard_of(home_partition(user_id, self.partitions)))

    def opened(self) -> list[tuple[int, AsyncPool]]:
        """Every shard with an open pool (the catalog's first): where background tasks are claimed."""
        return sorted(self._pools.items(), key=lambda item: item[0])

    async def close(self) -> None:
        """Close the shards' pools, the catalog's last."""
        for _shard, pool in sorted(self._pools.items(), reverse=True):
            await pool.close()
