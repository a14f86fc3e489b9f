"""Timers: typed functions over ``queries/timers.sql``.

Writers: the timers API and ``vigil timers`` (:func:`upsert`, :func:`cancel`), the scheduler
(:func:`claim_due`, :func:`apply`, :func:`set_aside`). The worker's finish inserts follow-ups
and approval expiries with its own statement (``finish.sql``). Every state change checks the
state it expects; the re-registration rule lives in ``timer_upsert`` itself so every writer
gets it (:mod:`vigil.scheduler.timers` explains it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb

from vigil.ledger.queries import Q
from vigil.ledger.states import CatchUp, TimerKind


@dataclass(frozen=True, slots=True)
class TimerRow:
    """A ``timers`` row as stored (schemas/ledger/schema.sql describes each column)."""

    id: str
    user_id: str
    kind: str
    due: datetime
    every_seconds: int | None
    cron: str | None
    tz: str
    catch_up: str
    max_lateness: int | None
    payload: dict[str, Any]
    fixed_key: str | None
    done: bool
    skipped: bool
    fired_count: int
    last_fired_at: datetime | None
    handled_through: datetime | None
    cancelled_at: datetime | None
    run_id: int | None  # the run whose finish last set it; None: the API or the CLI
    error: str | None
    created_at: datetime
    updated_at: datetime
    traceparent: str | None  # the setting run's trace context (traces on): the fire continues it

    @classmethod
    def of(cls, row: dict[str, Any]) -> TimerRow:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class NewTimer:
    """A validated timer, ready for :func:`upsert` (:func:`vigil.scheduler.timers.parse_timer`
    builds it from a request)."""

    user_id: str
    id: str
    kind: TimerKind
    due: int  # epoch seconds
    every: int | None = None
    cron: str | None = None
    tz: str = "UTC"
    catch_up: CatchUp = CatchUp.COALESCE
    max_lateness: int | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    fixed_key: str | None = None
    token_id: str | None = None  # the API token registering it (its quota); None: a run or the CLI

    def params(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "id": self.id,
            "kind": self.kind.value,
            "due": datetime.fromtimestamp(self.due, UTC),
            "every_seconds": self.every,
            "cron": self.cron,
            "tz": self.tz,
            "catch_up": self.catch_up.value,
            "max_lateness": self.max_lateness,
            "payload": Jsonb(self.payload),
            "fixed_key": self.fixed_key,
            "token_id": self.token_id,
        }


@dataclass(frozen=True)
class Upserted:
    """What ``timer_upsert`` did: ``status`` is created | updated | unchanged | conflict."""

    status: str
    row: TimerRow | None
    reason: str | None = None


def _outcome(returned: dict[str, Any] | None, existing: dict[str, Any] | None) -> Upserted:
    """Interpret ``timer_upsert``: ``existing`` is read only when it returned nothing."""
    if returned is not None:
        return Upserted("created" if returned["created"] else "updated", TimerRow.of(returned))
    row = None if existing is None else TimerRow.of(existing)
    if row is not None and row.kind == TimerKind.APPROVAL_EXPIRY:
        return Upserted(
            "conflict", row, "this id belongs to an approval's expiry timer, which only its approval changes"
        )
    return Upserted(
        "unchanged", row, "this one-off already fired (or was skipped) at or after the given due; nothing fires again"
    )


def upsert(conn: psycopg.Connection[Any], timer: NewTimer) -> Upserted:
    """Create or re-register ``timer`` (one transaction)."""
    with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)  # whatever rows the caller's connection makes
        returned = cur.execute(Q.timer_upsert, timer.params()).fetchone()
        existing = None if returned else cur.execute(Q.timer_get, timer.params()).fetchone()
    return _outcome(returned, existing)


async def upsert_async(conn: psycopg.AsyncConnection[Any], timer: NewTimer) -> Upserted:
    """:func:`upsert` on an async connection (the API's pool)."""
    async with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        returned = await (await cur.execute(Q.timer_upsert, timer.params())).fetchone()
        existing = None if returned else await (await cur.execute(Q.timer_get, timer.params())).fetchone()
    return _outcome(returned, existing)


def get(conn: psycopg.Connection[DictRow], *, user_id: str, timer_id: str) -> TimerRow | None:
    row = conn.execute(Q.timer_get, {"user_id": user_id, "id": timer_id}).fetchone()
    return None if row is None else TimerRow.of(row)


async def get_async(conn: psycopg.AsyncConnection[DictRow], *, user_id: str, timer_id: str) -> TimerRow | None:
    row = await (await conn.execute(Q.timer_get, {"user_id": user_id, "id": timer_id})).fetchone()
    return None if row is None else TimerRow.of(row)


def _list_params(user_id: str, include_done: bool, after: str, limit: int) -> dict[str, Any]:
    return {"user_id": user_id, "include_done": include_done, "after": after, "limit": limit}


def of_user(
    conn: psycopg.Connection[DictRow], user_id: str, *, include_done: bool, after: str, limit: int
) -> list[TimerRow]:
    """A user's timers in id order after ``after`` (keyset), live ones only unless ``include_done``."""
    rows = conn.execute(Q.timers_list, _list_params(user_id, include_done, after, limit)).fetchall()
    return [TimerRow.of(r) for r in rows]


async def of_user_async(
    conn: psycopg.AsyncConnection[DictRow], user_id: str, *, include_done: bool, after: str, limit: int
) -> list[TimerRow]:
    cursor = await conn.execute(Q.timers_list, _list_params(user_id, include_done, after, limit))
    return [TimerRow.of(r) for r in await cursor.fetchall()]


def cancel(conn: psycopg.Connection[DictRow], *, user_id: str, timer_id: str) -> bool:
    """A live timer the caller owns becomes done and cancelled. False: unknown, done already,
    or an approval's expiry (which follows its approval)."""
    return conn.execute(Q.timer_cancel, {"user_id": user_id, "id": timer_id}).fetchone() is not None


async def cancel_async(conn: psycopg.AsyncConnection[DictRow], *, user_id: str, timer_id: str) -> bool:
    cursor = await conn.execute(Q.timer_cancel, {"user_id": user_id, "id": timer_id})
    return await cursor.fetchone() is not None


@dataclass(frozen=True, slots=True)
class LiveCounts:
    """Live timers other than the one being (re-)registered: the user's, and the token's."""

    of_user: int
    of_token: int


async def quota_counts(
    conn: psycopg.AsyncConnection[DictRow], *, user_id: str, token_id: str, other_than: str
) -> LiveCounts:
    """Lock timer creation for ``user_id`` and then for ``token_id`` until the caller's
    transaction ends, then count what the quotas bound. Concurrent creates for one user or by
    one token (for any users) therefore count one after the other: the count and the insert
    that follows it in the same transaction cannot both pass a quota twice."""
    params = {"user_id": user_id, "token_id": token_id, "id": other_than}
    await conn.execute(Q.timers_quota_lock, params)
    row = await (await conn.execute(Q.timers_live_counts, params)).fetchone()
    assert row is not None  # counts: one row
    return LiveCounts(of_user=row["of_user"], of_token=row["of_token"])


# -- the scheduler's pass ------------------------------------------------------------------


def claim_due(conn: psycopg.Connection[DictRow], now: datetime, limit: int) -> list[TimerRow]:
    """Live timers due at ``now``, oldest first, locked (``FOR UPDATE SKIP LOCKED``) until the
    caller's transaction ends."""
    return [TimerRow.of(r) for r in conn.execute(Q.timers_claim_due, {"now": now, "limit": limit}).fetchall()]


@dataclass(frozen=True, slots=True)
class Advance:
    """One timer's planned state after a pass, applied only if its due is still ``expected_due``."""

    user_id: str
    id: str
    expected_due: datetime
    next_due: datetime | None  # None: keep the due (a finished one-off)
    done: bool
    skipped: bool
    fired: int
    handled_through: datetime | None


def apply(conn: psycopg.Connection[DictRow], now: datetime, advances: list[Advance]) -> int:
    """Commit one pass's plans in one statement; returns how many timers it advanced."""
    rows = conn.execute(
        Q.timers_apply,
        {
            "now": now,
            "user_ids": [a.user_id for a in advances],
            "ids": [a.id for a in advances],
            "expected_dues": [a.expected_due for a in advances],
            "next_dues": [a.next_due for a in advances],
            "dones": [a.done for a in advances],
            "skippeds": [a.skipped for a in advances],
            "fireds": [a.fired for a in advances],
            "handled": [a.handled_through for a in advances],
        },
    ).fetchall()
    return len(rows)


def set_aside(conn: psycopg.Connection[DictRow], row: TimerRow, error: str) -> bool:
    """A timer the scheduler cannot plan: done, with the reason, so it stops blocking the batch."""
    returned = conn.execute(
        Q.timer_set_aside, {"user_id": row.user_id, "id": row.id, "expected_due": row.due, "error": error}
    ).fetchone()
    return returned is not None


@dataclass(frozen=True, slots=True)
class DueBacklog:
    due: int  # live timers due
    oldest: datetime | None  # the oldest one's due


def due_backlog(conn: psycopg.Connection[DictRow], now: datetime) -> DueBacklog:
    row = conn.execute(Q.timers_due_count, {"now": now}).fetchone()
    assert row is not None  # a count: one row
    return DueBacklog(row["due"], row["oldest"])
