"""Daily token budgets in the ledger (``queries/budgets.sql``; docs/agent.md, "Budgets")."""

from __future__ import annotations

from datetime import date, datetime

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q

# How the error of an event waiting for its user's daily budget begins (the worker writes it;
# :func:`release` finds the waiting events by it).
WAITING_PREFIX = "budget: "


async def spent(conn: psycopg.AsyncConnection[DictRow], *, user_id: str, since: datetime) -> int:
    """Billed tokens of the user's runs started since ``since`` and of their background tasks
    (input + output, cache writes 1.25x, cache reads 0.1x, as the provider bills them)."""
    cur = await conn.execute(Q.budgets_spent, {"user_id": user_id, "since": since})
    row = await cur.fetchone()
    return int(row["spent"]) if row else 0


async def notify_once(
    conn: psycopg.AsyncConnection[DictRow], *, user_id: str, day: date, profile: str, body: str
) -> bool:
    """Queue the day's notice for the user (an outbox row, run 0); False when already sent."""
    cur = await conn.execute(Q.budgets_notify_once, {"user_id": user_id, "day": day, "profile": profile, "body": body})
    return await cur.fetchone() is not None


def release(conn: psycopg.Connection[DictRow], *, profile: str, now: datetime | None = None) -> int:
    """The events waiting for the daily budget of ``profile``'s users due now (its budget was
    changed); returns how many. ``now``: the caller's clock (None: the database's)."""
    cur = conn.execute(Q.budgets_release, {"profile": profile, "prefix": WAITING_PREFIX, "now": now})
    return cur.rowcount
