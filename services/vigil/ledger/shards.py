"""The shard map's rows in the catalog, and what ``vigil shards`` reads of each shard
(``queries/shards.sql``). The map's rule and its reading are :mod:`vigil.ledger.shardmap`.

Every function takes a connection in autocommit mode: a shard whose schema is behind (no
``shard_map``, no ``events_live`` yet) answers None instead of an error, and leaves no
aborted transaction behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.db import connect
from vigil.ledger.queries import Q
from vigil.ledger.shardmap import ShardMap, rule

Conn = psycopg.Connection[DictRow]  # vigil.ledger.db's connections: dict rows


@dataclass(frozen=True, slots=True)
class Lag:
    """What waits on one shard: events not yet done, and deliveries not yet made."""

    events_waiting: int
    outbox_pending: int


def assigned(conn: Conn) -> dict[int, int] | None:
    """The catalog's rows, partition -> shard; None before migration 0038 made the table."""
    try:
        return {int(row["partition"]): int(row["shard"]) for row in conn.execute(Q.shard_map_rows).fetchall()}
    except psycopg.errors.UndefinedTable:
        return None


def seed(conn: Conn, *, partitions: int, shards: int) -> int:
    """Rows for partitions ``0..partitions-1`` that have none, placed by the rule; returns how
    many were added. A row that exists is never rewritten: where a partition's users are is
    decided once, and moving them is changing the row."""
    every = list(range(partitions))
    cur = conn.execute(Q.shard_map_seed, {"partitions": every, "shards": [rule(p, shards=shards) for p in every]})
    return cur.rowcount


# The per-user tables whose ids come from an identity sequence. Ids are unique within a shard
# only, and `vigil shards move` copies them as they are: each shard's sequences start in a
# range of their own (:func:`space_ids`), so a moved row's id is nobody's on its new shard.
IDENTITY_TABLES = ("events", "memory_history", "outbox", "refunds", "runs")
# Shard k's ids start at k * IDS_PER_SHARD: a million ids a second for thirty years each, and
# every id below 2**53 (exact in JSON) for the first nine shards.
IDS_PER_SHARD = 10**15


def space_ids(conn: Conn, *, shard: int) -> list[str]:
    """Start the identity sequences of :data:`IDENTITY_TABLES` that have never given an id at
    ``shard * IDS_PER_SHARD`` (``vigil migrate``, shards after the first). A sequence in use is
    left alone: its shard's ids are what they are. Returns the tables whose sequence moved."""
    if shard == 0:
        return []
    unused = conn.execute(Q.shard_identities_unused, {"tables": list(IDENTITY_TABLES)}).fetchall()
    for row in unused:
        conn.execute(Q.shard_identity_start, {"seq": row["seq"], "start": shard * IDS_PER_SHARD})
    return [row["tbl"] for row in unused]


def schema_version(conn: Conn) -> int | None:
    """The newest migration recorded on this shard; None when none is."""
    try:
        row = conn.execute(Q.shard_schema_version).fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    return None if row is None or row["version"] is None else int(row["version"])


def lag(conn: Conn) -> Lag | None:
    """Counts of the two queues on this shard; None when its schema has not made them yet."""
    try:
        row = conn.execute(Q.shard_lag).fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    assert row is not None  # a SELECT without FROM returns one row
    return Lag(events_waiting=int(row["events_waiting"]), outbox_pending=int(row["outbox_pending"]))


def load_map(dsns: tuple[str, ...], *, connect_timeout: int | None = None) -> ShardMap:
    """The map the services route by: the shards' DSNs (``CommonSettings.shard_dsns``) and the
    catalog's rows, read from shard 0. One shard reads nothing: every partition is on it.
    Raises psycopg.OperationalError when the catalog does not answer, and
    :class:`~vigil.ledger.shardmap.ShardMapError` when a row names a shard not configured."""
    if len(dsns) == 1:
        return ShardMap(dsns)
    with connect(dsns[0], autocommit=True, connect_timeout=connect_timeout) as conn:
        rows = assigned(conn)
    return ShardMap(dsns, rows or {})
