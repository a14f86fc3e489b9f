"""Users' delivery channels: typed functions over ``queries/channels.sql``.

Operators write channels (``vigil channels set``, :mod:`vigil.dispatcher.operator`); the
dispatcher reads them in its claim (``outbox_lock_due_users`` in :mod:`vigil.ledger.outbox`).
A user without a row gets the log channel and the service's default limits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import date, datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow

from vigil.ledger import sealing
from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class ChannelRow:
    user_id: str
    type: str
    url: str | None
    secret: str | None
    gap_seconds: int | None
    urgent_daily_cap: int | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def of(cls, row: dict[str, Any]) -> ChannelRow:
        """The row with its secret opened (sealed in the ledger, :mod:`vigil.ledger.sealing`)."""
        return cls(**{f.name: row[f.name] for f in fields(cls)} | {"secret": _open(row)})


def _open(row: dict[str, Any]) -> str | None:
    return sealing.opened_or_left_out(row["secret"], row["sealed_with"], sealing.Place("channels", row["user_id"]))


@dataclass(frozen=True, slots=True)
class PacingState:
    """A user's pacing state in ``users`` (what the dispatcher's claim reads and restarts)."""

    last_delivery_at: datetime | None
    urgent_day: date | None
    urgent_count: int


def get(conn: psycopg.Connection[DictRow], user_id: str) -> ChannelRow | None:
    """A user's channel, if any."""
    row = conn.execute(Q.channel_get, {"user_id": user_id}).fetchone()
    return None if row is None else ChannelRow.of(row)


def of_users(conn: psycopg.Connection[DictRow], user_ids: list[str]) -> dict[str, ChannelRow]:
    """The channels of those of ``user_ids`` that have one, by user (read from the catalog by a
    dispatcher working another shard)."""
    rows = conn.execute(Q.channels_of_users, {"users": user_ids}).fetchall()
    return {row["user_id"]: ChannelRow.of(row) for row in rows}


@dataclass(frozen=True, slots=True)
class LockedChannel:
    """What an edit of a channel needs to know about the stored one."""

    type: str
    url: str | None
    secret: str | None


def lock(conn: psycopg.Connection[DictRow], user_id: str) -> LockedChannel | None:
    """A user's channel, locked until commit: two operators editing one channel must not both
    rotate its secret. None: no channel yet (nothing to lock; the insert's key decides)."""
    row = conn.execute(Q.channel_get_for_update, {"user_id": user_id}).fetchone()
    return None if row is None else LockedChannel(row["type"], row["url"], _open(row))


def set_channel(
    conn: psycopg.Connection[DictRow],
    *,
    user_id: str,
    type_: str,
    url: str | None,
    secret: str | None,
    gap_seconds: int | None,
    urgent_daily_cap: int | None,
    keep_gap: bool,
    keep_cap: bool,
) -> ChannelRow:
    """Create or replace a user's channel (its secret sealed with the current key);
    ``keep_gap`` / ``keep_cap`` keep the stored limits."""
    place = sealing.Place("channels", user_id)
    stored, sealed_with = sealing.keys().seal(secret, place) if secret is not None else (None, None)
    row = conn.execute(
        Q.channel_set,
        {
            "user_id": user_id,
            "type": type_,
            "url": url,
            "secret": stored,
            "sealed_with": sealed_with,
            "gap_seconds": gap_seconds,
            "urgent_daily_cap": urgent_daily_cap,
            "keep_gap": keep_gap,
            "keep_cap": keep_cap,
        },
    ).fetchone()
    assert row is not None  # an upsert returns its row
    return ChannelRow.of(row)


def pacing_state(conn: psycopg.Connection[DictRow], user_id: str) -> PacingState | None:
    """A user's pacing state; None for a user the ledger has never seen."""
    row = conn.execute(Q.channel_pacing_state, {"user_id": user_id}).fetchone()
    return None if row is None else PacingState(row["last_delivery_at"], row["urgent_day"], row["urgent_count"])


@dataclass(frozen=True, slots=True)
class AttentionState:
    """A user's earned gap (``users.attention_*``, migration 0031) and today's deliveries."""

    user_id: str
    attention_gap_s: int | None
    attention_reason: str | None
    attention_at: datetime | None
    attention_pinned: bool
    last_delivery_at: datetime | None
    delivery_day: date | None
    delivery_day_count: int


def attention(conn: psycopg.Connection[DictRow], user_id: str) -> AttentionState | None:
    """A user's attention state; None: no such user."""
    row = conn.execute(Q.attention_get, {"user_id": user_id}).fetchone()
    return None if row is None else AttentionState(**{f.name: row[f.name] for f in fields(AttentionState)})


def set_attention(
    conn: psycopg.Connection[DictRow], *, user_id: str, gap_s: int | None, reason: str, now: datetime
) -> AttentionState | None:
    """Pin ``user_id``'s gap at ``gap_s``, or (None) let it adapt again; None: no such user."""
    row = conn.execute(Q.attention_set, {"user_id": user_id, "gap_s": gap_s, "reason": reason, "now": now}).fetchone()
    return None if row is None else AttentionState(**{f.name: row[f.name] for f in fields(AttentionState)})
