"""Recovery from a ledger that lost its last commits (``queries/recovery.sql``): the ledger's
own consumer positions, recorded with the events they cover, and the heal that releases
claims no live run holds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.partitions import PartitionKey, keys_params, owned_params
from vigil.ledger.queries import Q


def read_positions(conn: psycopg.Connection[DictRow], keys: list[PartitionKey]) -> dict[PartitionKey, int]:
    """The ledger's next offset for each of ``keys`` it has recorded from."""
    rows = conn.execute(Q.read_positions, keys_params(keys)).fetchall()
    return {PartitionKey(row["topic"], row["partition"]): row["next_offset"] for row in rows}


@dataclass(frozen=True, slots=True)
class Healed:
    id: int
    user_id: str


async def release_orphaned_claims(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    owned: dict[PartitionKey, int],
    busy: list[str],
    max_attempts: int,
    backoff_base_s: float,
    backoff_cap_s: float,
    now: datetime | None = None,
) -> list[Healed]:
    """Events running at our epochs of users with no run in flight here (``busy``): back to
    pending, counted as lost with their worker (as a takeover counts them)."""
    cur = await conn.execute(
        Q.release_orphaned_claims,
        {
            **owned_params(owned),
            "busy": json.dumps(busy),  # a JSON array, as the claim takes it
            "max_attempts": max_attempts,
            "backoff_base": backoff_base_s,
            "backoff_cap": backoff_cap_s,
            "now": now,
        },
    )
    return [Healed(row["id"], row["user_id"]) for row in await cur.fetchall()]
