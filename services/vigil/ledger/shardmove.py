"""Moving a partition's users from one ledger shard to another (``vigil shards move``), over
``queries/shardmove.sql``. docs/operations.md, "Moving a partition to another shard".

No transaction spans two shards, so a move is a sequence of steps, each one idempotent, and
the catalog's ``shard_moves`` row says which step a run of the command starts from:

1. **Begin** (catalog): the row, state ``copying``, naming source and target.
2. **Fence** (source): take the partition's fencing row as the move (:data:`HOLDER`), bumping
   its epoch (:func:`vigil.ledger.partitions.take_over`, which waits for in-flight claims and
   finishes). From then on a worker that still believes it owns the partition cannot claim or
   finish there: every claim and finish checks the epoch. A run that finds the row still
   held by the move keeps its epoch; one taken over meanwhile is fenced again.
3. **Copy** (target), table by table in :data:`TABLES` order, chunks of users, each chunk
   one transaction on the target: binary COPY out of the source, into a staging table, then
   ``INSERT ... ON CONFLICT DO NOTHING`` with the ids as they are. A chunk copied by an
   interrupted run is skipped row by row. A staged id that the target gives another user
   stops the move (:class:`IdCollision`): the shards' identity sequences overlapped.
   consumer_positions comes first: a position never runs ahead of the events it covers.
4. **Verify**: per table, the count and a sum of row hashes of the moving users on both
   shards. A table that differs (a row changed on the source after an interrupted copy) is
   deleted from the target and copied again, once; still different, the move stops
   (:class:`MoveRefused`: something writes the partition's users, it is not paused).
   Then the target's identity sequences are advanced past the copied ids.
5. **Flip** (catalog, one statement): the fence is checked to be still the move's, then
   ``shard_map`` names the target and the row says ``flipped``. Until here the source is
   the truth and a crash loses nothing: the next run copies again.
6. **Delete** (source), table by table, chunk by chunk; the source's fencing row stays
   (the epochs there never go back). Then the row says ``done``.

The partition's users are those whose home partition
(:func:`vigil.partitioner.home_partition` among ``partitions``) is the partition: the users
:meth:`ShardMap.shard_of_user` routes by it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import DictRow

from vigil.errors import VigilError
from vigil.ledger import partitions as fencing
from vigil.ledger.db import connect
from vigil.ledger.queries import Q
from vigil.ledger.shardmap import ShardMap, ShardUnreachable
from vigil.ledger.shards import IDENTITY_TABLES, assigned
from vigil.ledger.states import MoveState
from vigil.partitioner import home_partition

Conn = psycopg.Connection[DictRow]

# The fencing row's holder while a move holds the partition (a worker's is its id).
HOLDER = "vigil shards move"

# The per-user tables, in copy order (deleted in the reverse). consumer_positions is the
# partition's own row and goes first: copied before the events, a position can only be
# behind them on the target, and an owner there re-reads from Kafka what the dedup key drops.
# The fencing row (partitions) is copied apart (move_fence_copy), never deleted.
PARTITION_TABLES = ("consumer_positions",)
USER_TABLES = (
    "users",
    "event_keys",
    "events",
    "runs",
    "run_journal",
    "outbox",
    "timers",
    "sessions",
    "memory",
    "memory_history",
    "tasks",
    "approvals",
    "budget_notices",
    "refunds",
)
TABLES = PARTITION_TABLES + USER_TABLES
# IDENTITY_TABLES (vigil.ledger.shards): ids copied as they are, checked for collisions, and
# the target's sequence advanced past them; `vigil migrate` starts each shard's apart.

# Users per chunk: one COPY and one target transaction each.
CHUNK_USERS = 200


class MoveError(VigilError):
    """A move that cannot go on; the message says why and what to do."""


class UnknownName(MoveError):
    """The partition or the shard named does not exist (exit 2)."""


class MoveRefused(MoveError):
    """The state forbids the step: another move in progress, rows that changed, a fence lost."""


class IdCollision(MoveRefused):
    """A copied row's id is another user's row on the target: the shards' sequences overlap."""


@dataclass(frozen=True, slots=True)
class Tally:
    """One table's rows of the moving users on a shard: how many, and a sum of their hashes."""

    rows: int
    hash: int


@dataclass(frozen=True, slots=True)
class Plan:
    """What a move of ``partition`` does: from ``source`` to ``target``, ``users`` (their
    count), and per table the rows on each side (a dry run prints it)."""

    partition: int
    source: int
    target: int
    state: str | None  # the catalog's move in progress, None: none
    users: int
    rows: dict[str, tuple[int, int]]  # table -> (rows on the source, rows on the target)


Step = Callable[[str], None]


def _nothing(_: str) -> None:
    return None


@dataclass
class _Shards:
    """Connections (autocommit) to the catalog, the source and the target, opened once."""

    dsns: Sequence[str]
    opened: dict[int, Conn]

    def __getitem__(self, index: int) -> Conn:
        if index not in self.opened:
            try:
                self.opened[index] = connect(self.dsns[index], autocommit=True, connect_timeout=5)
            except psycopg.OperationalError as exc:
                raise ShardUnreachable(index, self.dsns[index], str(exc).split("\n")[0]) from exc
        return self.opened[index]


@contextmanager
def _shards(dsns: Sequence[str]) -> Iterator[_Shards]:
    shards = _Shards(dsns, {})
    try:
        yield shards
    finally:
        for conn in shards.opened.values():
            conn.close()


def _q(name: str, table: str) -> sql.Composed:
    return sql.SQL(Q[name]).format(table=sql.Identifier(table))


def _chunks(users: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(users), CHUNK_USERS):
        yield users[i : i + CHUNK_USERS]


def partition_users(conn: Conn, *, partition: int, partitions: int) -> list[str]:
    """The users with rows on this shard whose home partition is ``partition``, sorted."""
    every = [row["user_id"] for row in conn.execute(Q.move_user_ids).fetchall()]
    return sorted(u for u in every if home_partition(u, partitions) == partition)


def _tally(conn: Conn, table: str, *, users: list[str], key: dict[str, Any]) -> Tally:
    if table in PARTITION_TABLES:
        row = conn.execute(_q("move_tally_partition", table), key).fetchone()
    else:
        row = conn.execute(_q("move_tally_users", table), {"users": users}).fetchone()
    assert row is not None  # an aggregate returns one row
    return Tally(rows=int(row["n"]), hash=int(row["hash"]))


def _copy_chunk(source: Conn, target: Conn, table: str, *, out: sql.Composed, params: dict[str, Any]) -> None:
    """One chunk, one target transaction: COPY out of the source into the target's staging
    table, refuse ids that collide, insert what the target does not have yet."""
    with target.transaction():
        target.execute(_q("move_stage", table))
        with source.cursor().copy(out, params) as rows, target.cursor().copy(Q.move_in) as into:
            for data in rows:
                into.write(data)
        if table in IDENTITY_TABLES:
            found = target.execute(_q("move_id_collisions", table)).fetchone()
            if found is not None and found["n"]:
                raise IdCollision(
                    f"{found['n']} row(s) of {table} have ids the target already gives other users: the shards' "
                    'identity sequences overlap (docs/operations.md, "Moving a partition to another shard")'
                )
        names = [row["attname"] for row in target.execute(Q.move_columns, {"table": table}).fetchall()]
        columns = sql.SQL(", ").join(map(sql.Identifier, names))
        target.execute(sql.SQL(Q.move_insert).format(table=sql.Identifier(table), columns=columns))


def _copy_table(source: Conn, target: Conn, table: str, *, users: list[str], key: dict[str, Any]) -> None:
    if table in PARTITION_TABLES:
        _copy_chunk(source, target, table, out=_q("move_out_partition", table), params=key)
        return
    for chunk in _chunks(users):
        _copy_chunk(source, target, table, out=_q("move_out_users", table), params={"users": chunk})


def _delete_table(conn: Conn, table: str, *, users: list[str], key: dict[str, Any]) -> None:
    if table in PARTITION_TABLES:
        conn.execute(_q("move_delete_partition", table), key)
        return
    for chunk in _chunks(users):
        conn.execute(_q("move_delete_users", table), {"users": chunk})


def _fence(conn: Conn, key: fencing.PartitionKey) -> int:
    """Step 2: the move's epoch on the source, taken now unless the move still holds it."""
    row = conn.execute(Q.move_fence_row, {"topic": key.topic, "partition": key.partition}).fetchone()
    if row is not None and row["holder"] == HOLDER:
        return int(row["epoch"])
    with conn.transaction():
        return fencing.take_over(conn, key, HOLDER)


def _load(shards: _Shards, *, partition: int, target: int, partitions: int) -> tuple[ShardMap, DictRow | None]:
    """The map and the partition's move row from the catalog; unknown names refused."""
    catalog = shards[0]
    shard_map = ShardMap(tuple(shards.dsns), assigned(catalog) or {})
    if not 0 <= target < shard_map.count:
        raise UnknownName(
            f"unknown shard {target}: VIGIL_LEDGER_SHARDS lists {shard_map.count} (0-{shard_map.count - 1})"
        )
    if partition < 0 or (partition >= partitions and partition not in shard_map.assigned):
        raise UnknownName(f"unknown partition {partition}: VIGIL_PARTITIONS is {partitions} (0-{partitions - 1})")
    return shard_map, catalog.execute(Q.move_row, {"partition": partition}).fetchone()


def plan(dsns: Sequence[str], *, partition: int, target: int, partitions: int, topic: str) -> Plan:
    """What :func:`move` would do, read from the catalog, the source and the target; writes
    nothing (``vigil shards move --dry-run``)."""
    with _shards(dsns) as shards:
        shard_map, row = _load(shards, partition=partition, target=target, partitions=partitions)
        in_progress = row is not None and row["state"] != MoveState.DONE
        source = int(row["source"]) if in_progress and row is not None else shard_map.shard_of(partition)
        state = str(row["state"]) if in_progress and row is not None else None
        if source == target:
            return Plan(partition, source, target, state, 0, {})
        users = partition_users(shards[source], partition=partition, partitions=partitions)
        key = {"topic": topic, "partition": partition}
        rows = {
            t: (
                _tally(shards[source], t, users=users, key=key).rows,
                _tally(shards[target], t, users=users, key=key).rows,
            )
            for t in TABLES
        }
        return Plan(partition, source, target, state, len(users), rows)


def move(
    dsns: Sequence[str], *, partition: int, target: int, partitions: int, topic: str, on_step: Step = _nothing
) -> Plan:
    """Move ``partition``'s users to shard ``target`` and point the map there (the steps and
    what an interruption leaves: this module's docstring). ``on_step`` hears each step as it
    ends ("fenced", "copied <table>", "verified", "flipped", "deleted <table>", "done"): the
    command prints them, and a test raises in it to interrupt the move there. Returns the plan
    it carried out (``source == target``: nothing to do, nothing done)."""
    with _shards(dsns) as shards:
        shard_map, row = _load(shards, partition=partition, target=target, partitions=partitions)
        catalog = shards[0]
        if row is not None and row["state"] != MoveState.DONE:
            if int(row["target"]) != target:
                raise MoveRefused(
                    f"partition {partition} is being moved to shard {row['target']} (state {row['state']}): "
                    f"finish that move first (vigil shards move {partition} --to {row['target']})"
                )
            source, state = int(row["source"]), str(row["state"])
        else:
            source, state = shard_map.shard_of(partition), MoveState.COPYING
            if source == target:
                return Plan(partition, source, target, None, 0, {})
            shards[source], shards[target]  # both answer before the move is recorded
            if (
                catalog.execute(Q.move_begin, {"partition": partition, "source": source, "target": target}).rowcount
                != 1
            ):
                raise MoveRefused(f"partition {partition}: another move began at the same time; run the command again")
        key = {"topic": topic, "partition": partition}
        users = partition_users(shards[source], partition=partition, partitions=partitions)
        if state == MoveState.COPYING:
            _copy_verify_flip(shards, source=source, target=target, users=users, key=key, on_step=on_step)
        for table in reversed(TABLES):
            _delete_table(shards[source], table, users=users, key=key)
            on_step(f"deleted {table}")
        catalog.execute(Q.move_done, {"partition": partition})
        on_step("done")
        return Plan(partition, source, target, MoveState.DONE, len(users), {})


def _copy_verify_flip(
    shards: _Shards, *, source: int, target: int, users: list[str], key: dict[str, Any], on_step: Step
) -> None:
    """Steps 2 to 5 (fence, copy, verify, flip): the source is the truth throughout."""
    src, dst = shards[source], shards[target]
    partition_key = fencing.PartitionKey(key["topic"], key["partition"])
    epoch = _fence(src, partition_key)
    on_step("fenced")
    for table in TABLES:
        _copy_table(src, dst, table, users=users, key=key)
        on_step(f"copied {table}")
    for table in TABLES:
        if _tally(src, table, users=users, key=key) == _tally(dst, table, users=users, key=key):
            continue
        # Rows that changed on the source after an interrupted run copied them: copy afresh.
        _delete_table(dst, table, users=users, key=key)
        _copy_table(src, dst, table, users=users, key=key)
        was, now = _tally(src, table, users=users, key=key), _tally(dst, table, users=users, key=key)
        if was != now:
            raise MoveRefused(
                f"{table}: shard {source} has {was.rows} row(s) of partition {key['partition']}'s users, shard "
                f"{target} {now.rows} after copying them again; something still writes them: pause the partition "
                "(docs/operations.md) and run the command again"
            )
    for table in sorted(IDENTITY_TABLES):
        dst.execute(_q("move_advance_identity", table), {"table": table})
    on_step("verified")
    fence = src.execute(Q.move_fence_row, key).fetchone()
    if fence is None or fence["holder"] != HOLDER or int(fence["epoch"]) != epoch:
        holder = None if fence is None else fence["holder"]
        raise MoveRefused(
            f"partition {key['partition']} was taken over on shard {source} during the move (holder {holder}): "
            "pause it (docs/operations.md) and run the command again"
        )
    dst.execute(Q.move_fence_copy, {**key, "epoch": epoch, "holder": HOLDER})
    flipped = shards[0].execute(Q.move_flip, {"partition": key["partition"], "target": target}).fetchone()
    if flipped is None:
        raise MoveRefused(f"partition {key['partition']}: the move's record changed meanwhile; run the command again")
    on_step("flipped")
