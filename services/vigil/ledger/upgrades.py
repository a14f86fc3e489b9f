"""In-flight runs moved to a newer profile version (``queries/upgrades.sql``).

``vigil runs upgrade`` reads the live journals of a profile's older versions and writes one
``run_upgrades`` row per run it moves, in one transaction per shard with its audit row; the
agent reads a replayed run's latest row and goes on under that version (docs/agent.md,
"Changing an agent safely")."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class InFlight:
    """A run with a live journal on an older version of the profile."""

    run_key: str
    user_id: str
    from_version: int
    steps: int  # journaled steps: model answers and action calls
    calls_done: int  # action calls with an outcome: facts, never executed again
    calls_in_doubt: int  # intent without an outcome: executed again with the same key, if still offered
    claimed: bool  # a worker holds the run now (else it waits for its replay)


@dataclass(frozen=True, slots=True)
class UpgradeRow:
    run_key: str
    profile: str
    from_version: int
    to_version: int
    made_at: datetime
    made_by: str


def in_flight(conn: psycopg.Connection[DictRow], *, profile: str, to_version: int) -> list[InFlight]:
    """The runs of ``profile`` in flight on a version older than ``to_version``."""
    rows = conn.execute(Q.upgrades_in_flight, {"profile": profile, "to_version": to_version})
    return [InFlight(**row) for row in rows]


def move(
    conn: psycopg.Connection[DictRow], runs: list[InFlight], *, profile: str, to_version: int, made_by: str
) -> list[str]:
    """Move ``runs`` (read by :func:`in_flight` in the caller's transaction) to ``to_version``.
    Returns the keys of those moved: a run whose journal ended meanwhile is not."""
    params = {
        "run_keys": [r.run_key for r in runs],
        "user_ids": [r.user_id for r in runs],
        "from_versions": [r.from_version for r in runs],
        "profile": profile,
        "to_version": to_version,
        "made_by": made_by,
    }
    return [row["run_key"] for row in conn.execute(Q.upgrades_move, params)]


async def latest(conn: psycopg.AsyncConnection[DictRow], *, run_key: str, profile: str) -> int | None:
    """The version run ``run_key`` of ``profile`` was last moved to; None: never moved."""
    cursor = await conn.execute(Q.upgrades_latest, {"run_key": run_key, "profile": profile})
    row = await cursor.fetchone()
    return None if row is None else row["to_version"]


def of_run(conn: psycopg.Connection[DictRow], run_key: str) -> list[UpgradeRow]:
    """A run's upgrades (``<user>:<first event id>``), oldest first."""
    params = {"user_id": run_key.rpartition(":")[0], "run_key": run_key}
    return [UpgradeRow(**row) for row in conn.execute(Q.upgrades_of_run, params)]
