"""The outbox: typed functions over ``queries/outbox.sql``.

The dispatcher's claim (:mod:`vigil.dispatcher.claims`) calls the first six in one
transaction, in order: :func:`lock_due_users`, :func:`unfinished_for_users`, then
:func:`fix_deliveries` and :func:`record_pacing`, :func:`claim_retries`, :func:`bury_lost`.
Each write is one statement that checks the state it expects and returns what it moved, so
the caller can compare it with what it planned. :func:`mark_delivered` (every accepted
delivery that arrived together, in one statement), :func:`schedule_retry` and
:func:`mark_dead` record attempts' outcomes, each only if its attempt still holds the
delivery. The rest are the operators' views and the backlog gauges.

Every time is the dispatcher's clock (``now``), never the server's ``now()``: one clock
decides gaps, backoffs and send leases, and tests move it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from datetime import date, datetime
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from psycopg.rows import DictRow

from vigil.ledger import sealing
from vigil.ledger.queries import Q

T = TypeVar("T")


def _rows(cls: type[T], rows: list[dict[str, Any]]) -> list[T]:
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    return [cls(**{n: row[n] for n in names}) for row in rows]


@dataclass(frozen=True, slots=True)
class UnfinishedRow:
    """An unfinished outbox row (pending or sending) as the claim reads it."""

    id: int
    user_id: str
    run_id: int
    body: str
    urgent: bool
    created_at: datetime
    status: str
    delivery_id: UUID | None
    attempts: int
    next_attempt_at: datetime | None
    fixed_at: datetime | None
    session_id: str | None = None  # the conversation that wrote it
    deadline: datetime | None = None  # an approval question's: never held by the urgent cap
    traceparent: str | None = None  # the writing run's trace context (traces on): the delivery continues it
    actions: list[dict[str, Any]] | None = None  # an approval question's approve / deny actions (signed answer URLs)


@dataclass(frozen=True, slots=True)
class DueUser:
    """A user locked by the claim: pacing state (``users``) and channel (``channels``; type
    None: no row, the log channel and the default limits)."""

    user_id: str
    last_delivery_at: datetime | None
    urgent_day: date | None
    urgent_count: int
    type: str | None
    url: str | None
    secret: str | None
    gap_seconds: int | None
    urgent_daily_cap: int | None
    attention_gap_s: int | None = None  # the user's earned gap (a channel's gap_seconds wins)


@dataclass(frozen=True, slots=True)
class Backlog:
    status: str
    messages: int
    oldest: datetime


@dataclass(frozen=True, slots=True)
class UserOutboxRow:
    """One row of ``vigil outbox USER``."""

    id: int
    run_id: int
    epoch: int
    created_at: datetime
    status: str
    urgent: bool
    attempts: int
    delivery_id: UUID | None
    channel: str | None
    fixed_at: datetime | None
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    dead_at: datetime | None
    error: str | None
    body: str
    session_id: str | None  # the conversation that wrote it: a reply naming it continues it
    deadline: datetime | None  # an approval question's


@dataclass(frozen=True, slots=True)
class DeadDelivery:
    """A dead delivery, all its rows in one (``vigil outbox --dead``, ``vigil dead``)."""

    delivery_id: UUID | None
    user_id: str
    dead_at: datetime | None
    attempts: int
    channel: str | None
    error: str | None
    messages: int
    outbox_ids: list[int]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Revived:
    id: int
    user_id: str


# -- the claim ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DueUsers:
    """The users a claim locked, where the next claim's sweep starts ('' from the first user),
    the outbox's highest id the claim could see (0: an empty outbox), and (between sweeps) the
    users looked at whose messages are not due yet, each with the moment that may change."""

    users: list[DueUser]
    cursor: str
    high: int
    waits: list[tuple[str, datetime]] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # ids looked at between sweeps with no row (yet)


def lock_due_users(
    conn: psycopg.Connection[DictRow],
    *,
    now: datetime,
    default_gap_s: int,
    limit: int,
    after: str = "",
    fresh_after: int | None = None,
    fresh_max: int = 0,
    recheck: list[str] | None = None,
    gaps: list[int] | None = None,
) -> DueUsers:
    """Lock (``FOR UPDATE SKIP LOCKED``, until commit) up to ``limit`` users who may have
    something to send at ``now``: looking at users in user_id order after ``after`` (a sweep),
    or, given ``fresh_after``, only at users with unfinished rows among the ``fresh_max`` ids
    after it and the ids in ``gaps``, and at the users in ``recheck`` (and then also the ones
    among them that hold messages not due yet, with when that may change, and the ids looked
    at that have no row yet)."""
    rows = conn.execute(
        Q.outbox_lock_due_users,
        {
            "now": now,
            "default_gap": default_gap_s,
            "limit": limit,
            "after": after,
            "fresh_after": fresh_after,
            "fresh_max": fresh_max,
            "recheck": recheck or [],
            "gaps": gaps or [],
        },
    ).fetchall()
    locked = [_opened(r) for r in rows if r["wake_at"] is None and r["user_id"] is not None]
    waits = [(r["user_id"], r["wake_at"]) for r in rows if r["wake_at"] is not None]
    return DueUsers(_rows(DueUser, locked), rows[0]["cursor"], rows[0]["high"] or 0, waits, rows[0]["missing"] or [])


def _opened(row: dict[str, Any]) -> dict[str, Any]:
    place = sealing.Place("channels", row["user_id"])
    return {**row, "secret": sealing.opened_or_left_out(row["secret"], row["sealed_with"], place)}


def unfinished_for_users(conn: psycopg.Connection[DictRow], users: list[str], max_messages: int) -> list[UnfinishedRow]:
    """The locked users' pending and sending rows, by user and id: every row of a fixed
    delivery, the oldest ``max_messages`` held ones."""
    rows = conn.execute(Q.outbox_unfinished_for_users, {"users": list(users), "max_messages": max_messages})
    return _rows(UnfinishedRow, rows.fetchall())


def fix_deliveries(
    conn: psycopg.Connection[DictRow],
    *,
    now: datetime,
    lease_until: datetime,
    ids: list[int],
    delivery_ids: list[UUID],
    channels: list[str],
) -> set[int]:
    """Fix ``delivery_ids[i]`` on held row ``ids[i]`` (pending -> sending under a lease);
    returns the ids of the rows that were still held."""
    rows = conn.execute(
        Q.outbox_fix_deliveries,
        {"now": now, "lease_until": lease_until, "ids": ids, "delivery_ids": delivery_ids, "channels": channels},
    ).fetchall()
    return {r["id"] for r in rows}


@dataclass(frozen=True, slots=True)
class Attention:
    """How the earned gap adapts (docs/agent.md, "Attention"); ``adapt`` False: it stays as is."""

    adapt: bool = False
    min_gap_s: int = 0
    max_gap_s: int = 0
    window_s: int = 0


@dataclass(frozen=True, slots=True)
class Paced:
    """A user whose new delivery was recorded: was the one before it answered (None: there was
    none), and the day count this delivery's day replaced (for messages per user per day)."""

    user_id: str
    replied: bool | None
    previous_day: date | None
    previous_day_count: int


def record_pacing(
    conn: psycopg.Connection[DictRow],
    now: datetime,
    users: list[str],
    seen: list[datetime | None],
    bypass: list[bool],
    attention: Attention = Attention(),
) -> dict[str, Paced]:
    """Restart each user's gap at ``now`` (a bypass also counts against today's urgent cap)
    and adapt the earned gap to whether the previous delivery was answered, only where
    ``last_delivery_at`` is still what the plan read (``seen``); returns those users."""
    rows = conn.execute(
        Q.outbox_record_pacing,
        {
            "now": now,
            "today": now.date(),
            "users": users,
            "seen": seen,
            "bypass": bypass,
            "adapt": attention.adapt,
            "min_gap": attention.min_gap_s,
            "max_gap": attention.max_gap_s,
            "window": attention.window_s,
        },
    ).fetchall()
    return {r["user_id"]: p for r in rows for p in _rows(Paced, [r])}


def claim_retries(
    conn: psycopg.Connection[DictRow],
    *,
    now: datetime,
    lease_until: datetime,
    delivery_ids: list[UUID],
    channels: list[str],
) -> set[int]:
    """Send fixed deliveries again under their own ids (a backoff ended, or a lease ran out);
    returns the ids of the rows moved."""
    rows = conn.execute(
        Q.outbox_claim_retries,
        {
            "now": now,
            "lease_until": lease_until,
            "delivery_ids": delivery_ids,
            "channels": json.dumps({str(d): channel for d, channel in zip(delivery_ids, channels, strict=True)}),
        },
    ).fetchall()
    return {r["id"] for r in rows}


def bury_lost(conn: psycopg.Connection[DictRow], now: datetime, delivery_ids: list[UUID]) -> set[int]:
    """Deliveries that used their last attempt with no outcome recorded become dead; returns
    the ids of the rows moved."""
    rows = conn.execute(Q.outbox_bury_lost, {"now": now, "delivery_ids": delivery_ids}).fetchall()
    return {r["id"] for r in rows}


# -- outcomes ----------------------------------------------------------------------------


def mark_delivered(
    conn: psycopg.Connection[DictRow], attempts: dict[UUID, int], now: datetime
) -> dict[UUID, list[datetime]]:
    """The channel accepted each delivery at its attempt (``attempts``), in one statement: the
    delivered rows' creation times by delivery (empty: that attempt no longer holds the
    delivery; it went out again)."""
    rows = conn.execute(
        Q.outbox_mark_delivered,
        {
            "now": now,
            "delivery_ids": list(attempts),
            "attempts": json.dumps({str(d): attempt for d, attempt in attempts.items()}),
        },
    ).fetchall()
    created: dict[UUID, list[datetime]] = {d: [] for d in attempts}
    for r in rows:
        created[r["delivery_id"]].append(r["created_at"])
    return created


def schedule_retry(
    conn: psycopg.Connection[DictRow], delivery_id: UUID, attempt: int, next_attempt_at: datetime, error: str
) -> int:
    """Attempt ``attempt`` failed and may be retried from ``next_attempt_at``: rows moved (0:
    superseded)."""
    rows = conn.execute(
        Q.outbox_schedule_retry,
        {"next_attempt_at": next_attempt_at, "error": error, "delivery_id": delivery_id, "attempt": attempt},
    ).fetchall()
    return len(rows)


def mark_dead(conn: psycopg.Connection[DictRow], delivery_id: UUID, attempt: int, now: datetime, error: str) -> int:
    """Attempt ``attempt`` failed for good: rows moved (0: superseded)."""
    rows = conn.execute(
        Q.outbox_mark_dead, {"now": now, "error": error, "delivery_id": delivery_id, "attempt": attempt}
    ).fetchall()
    return len(rows)


# -- views -------------------------------------------------------------------------------


def backlog(conn: psycopg.Connection[DictRow]) -> list[Backlog]:
    """Undelivered rows by status, with the oldest one's creation time."""
    return _rows(Backlog, conn.execute(Q.outbox_backlog).fetchall())


def of_user(conn: psycopg.Connection[DictRow], user_id: str, limit: int) -> list[UserOutboxRow]:
    """A user's outbox, newest first."""
    return _rows(UserOutboxRow, conn.execute(Q.outbox_for_user, {"user_id": user_id, "limit": limit}).fetchall())


def dead_deliveries(conn: psycopg.Connection[DictRow], limit: int) -> list[DeadDelivery]:
    """Dead deliveries, newest first."""
    return _rows(DeadDelivery, conn.execute(Q.outbox_dead_deliveries, {"limit": limit}).fetchall())


def revive_dead(conn: psycopg.Connection[DictRow], delivery_id: UUID | str, now: datetime) -> list[Revived]:
    """A dead delivery back to pending under its own id, attempts starting over (empty:
    nothing dead by that id)."""
    rows = conn.execute(Q.outbox_revive_dead, {"delivery_id": delivery_id, "now": now}).fetchall()
    return _rows(Revived, rows)


@dataclass(frozen=True, slots=True)
class DeliverySession:
    session_id: str | None  # None: the delivery came from no conversation (the echo agent's)


async def delivery_session(
    conn: psycopg.AsyncConnection[DictRow], user_id: str, delivery_id: UUID
) -> DeliverySession | None:
    """The conversation a delivery to this user came from; None: no such delivery for this user."""
    cursor = await conn.execute(Q.outbox_delivery_session, {"user_id": user_id, "delivery_id": delivery_id})
    row = await cursor.fetchone()
    return None if row is None else DeliverySession(row["session_id"])
