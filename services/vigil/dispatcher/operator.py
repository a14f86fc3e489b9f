"""What operators do to channels and deliveries, as functions (the CLI is a thin layer).

``dead_deliveries`` is also what ``vigil dead`` lists next to dead events.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from urllib.parse import urlparse

import psycopg
from psycopg.rows import DictRow

from vigil.cliutil import login_name
from vigil.dispatcher.channels import new_secret
from vigil.errors import VigilError
from vigil.ledger import audit, channels, outbox
from vigil.ledger.states import ChannelType
from vigil.outbound import AddressPolicy

KEEP = object()  # "leave the stored value as it is" for the optional limits


class ChannelError(VigilError, ValueError):
    """An operator's channel request that cannot be stored; the message says why."""


@dataclass(frozen=True)
class ChannelSet:
    row: dict
    new_secret: str | None  # shown once: only when this call generated it


def check_url(url: str | None, policy: AddressPolicy) -> str:
    """The send-time policy's rules, at the time the URL is set (issue 58): a URL that could
    never be sent to is refused now, not stored to fail every delivery."""
    if not url:
        raise ChannelError("--type webhook needs --url")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ChannelError(f"--url must be an http(s) URL, got {url!r}")
    problem = policy.url_problem(url)
    if problem is not None:
        # Not echoed: the URL may hold a password.
        raise ChannelError(f"--url: {problem}")
    return url


def set_channel(
    conn: psycopg.Connection[DictRow],
    user_id: str,
    type_: ChannelType,
    url: str | None = None,
    gap_seconds: int | None | object = KEEP,
    urgent_cap: int | None | object = KEEP,
    rotate_secret: bool = False,
    actor: str | None = None,
    policy: AddressPolicy | None = None,
) -> ChannelSet:
    """Create or change a user's channel in one transaction, audited (without the secret).

    A webhook gets a generated signing secret the first time (or with ``rotate_secret``);
    it is returned once and never shown again. ``KEEP`` leaves a stored limit as it is;
    None puts it back to the service default. ``policy``: ``VIGIL_OUTBOUND_ALLOWED_NETS``'s
    (none: public addresses only).
    """
    if type_ is ChannelType.WEBHOOK:
        url = check_url(url, policy or AddressPolicy())
    elif url:
        raise ChannelError(f"--url is only for --type webhook, not {type_.value}")
    for name, value in (("--gap", gap_seconds), ("--urgent-cap", urgent_cap)):
        if value is not KEEP and value is not None and (not isinstance(value, int) or value < 0):
            raise ChannelError(f"{name} must be a whole number >= 0")
    with conn.transaction():
        current = channels.lock(conn, user_id)
        # A webhook keeps its signing secret across edits (the receiver holds it); other
        # types drop it, so a later webhook gets a fresh one.
        stored = current.secret if current is not None and current.type == ChannelType.WEBHOOK else None
        generated = new_secret() if type_ is ChannelType.WEBHOOK and (rotate_secret or not stored) else None
        row = channels.set_channel(
            conn,
            user_id=user_id,
            type_=type_.value,
            url=url,
            secret=generated or (stored if type_ is ChannelType.WEBHOOK else None),
            gap_seconds=None if gap_seconds is KEEP else gap_seconds,  # type: ignore[arg-type]
            urgent_daily_cap=None if urgent_cap is KEEP else urgent_cap,  # type: ignore[arg-type]
            keep_gap=gap_seconds is KEEP,
            keep_cap=urgent_cap is KEEP,
        )
        detail = {k: getattr(row, k) for k in ("user_id", "type", "url", "gap_seconds", "urgent_daily_cap")}
        detail["secret_generated"] = generated is not None
        audit.record(conn, actor=actor or login_name(), action="channel.set", detail=detail)
    return ChannelSet(row=asdict(row), new_secret=generated)


def show_channel(
    conn: psycopg.Connection[DictRow],
    user_id: str,
    default_gap: int,
    default_cap: int,
    catalog: psycopg.Connection[DictRow] | None = None,
) -> dict:
    """A user's channel with the limits in effect; the secret only as whether one is set.
    ``conn``: the user's shard (pacing); ``catalog``: shard 0 (the channel), ``conn`` if None."""
    row = channels.get(catalog or conn, user_id)
    pacing = channels.pacing_state(conn, user_id)
    shown = {
        "user_id": user_id,
        "type": row.type if row else ChannelType.LOG.value,
        "configured": row is not None,
        "url": row.url if row else None,
        "secret_set": bool(row and row.secret),
        "gap_seconds": row.gap_seconds if row and row.gap_seconds is not None else default_gap,
        "gap_is_default": not (row and row.gap_seconds is not None),
        "urgent_daily_cap": row.urgent_daily_cap if row and row.urgent_daily_cap is not None else default_cap,
        "urgent_cap_is_default": not (row and row.urgent_daily_cap is not None),
        "last_delivery_at": pacing.last_delivery_at if pacing else None,
        "urgent_today": (pacing.urgent_count if pacing and pacing.urgent_day == datetime.now(UTC).date() else 0),
    }
    return shown


def show_user(
    conn: psycopg.Connection[DictRow],
    user_id: str,
    default_gap: int,
    catalog: psycopg.Connection[DictRow] | None = None,
) -> dict | None:
    """A user's effective gap and why: a channel's gap wins, then the earned (or pinned) gap,
    then VIGIL_OUTBOX_GAP; with today's deliveries. None: no such user. ``conn``: the user's
    shard (attention); ``catalog``: shard 0 (the channel), ``conn`` if None."""
    state = channels.attention(conn, user_id)
    if state is None:
        return None
    row = channels.get(catalog or conn, user_id)
    if row is not None and row.gap_seconds is not None:
        gap, source, reason = row.gap_seconds, "channel", "set on the channel (vigil channels set --gap)"
    elif state.attention_gap_s is not None:
        gap, source = state.attention_gap_s, "pinned" if state.attention_pinned else "earned"
        reason = state.attention_reason or ""
    else:
        gap, source, reason = default_gap, "default", "VIGIL_OUTBOX_GAP: attention has not adapted yet"
    today = datetime.now(UTC).date()
    return {
        "user_id": user_id,
        "gap_seconds": gap,
        "gap_source": source,
        "reason": reason,
        "attention_gap_seconds": state.attention_gap_s,
        "attention_pinned": state.attention_pinned,
        "attention_changed_at": state.attention_at,
        "last_delivery_at": state.last_delivery_at,
        "deliveries_today": state.delivery_day_count if state.delivery_day == today else 0,
    }


def set_attention(conn: psycopg.Connection[DictRow], user_id: str, gap_s: int | None, actor: str | None = None) -> bool:
    """Pin a user's gap (``gap_s``) or let it adapt again (None), audited; False: no such user."""
    reason = f"pinned by {actor or login_name()}" if gap_s is not None else "adapting again (override removed)"
    with conn.transaction():
        state = channels.set_attention(conn, user_id=user_id, gap_s=gap_s, reason=reason, now=datetime.now(UTC))
        if state is not None:
            audit.record(
                conn,
                actor=actor or login_name(),
                action="user.attention",
                detail={"user_id": user_id, "gap_seconds": gap_s},
            )
    return state is not None


def outbox_rows(conn: psycopg.Connection[DictRow], user_id: str, limit: int = 50) -> list[dict]:
    return [asdict(r) for r in outbox.of_user(conn, user_id, limit)]


def dead_deliveries(conn: psycopg.Connection[DictRow], limit: int = 100) -> list[dict]:
    """Dead deliveries, newest first, one dict per delivery id: ``delivery_id, user_id,
    dead_at, attempts, channel, error, messages, outbox_ids, created_at``."""
    return [asdict(r) for r in outbox.dead_deliveries(conn, limit)]


def revive_delivery(conn: psycopg.Connection[DictRow], delivery_id: str, actor: str | None = None) -> list[dict]:
    """Send a dead delivery again, same id, attempts starting over. Empty: nothing dead by that id."""
    with conn.transaction():
        rows = outbox.revive_dead(conn, delivery_id, datetime.now(UTC))
        if rows:
            detail = {"delivery_id": delivery_id, "user_id": rows[0].user_id, "outbox_ids": [r.id for r in rows]}
            audit.record(conn, actor=actor or login_name(), action="delivery.revive", detail=detail)
    return [asdict(r) for r in rows]


def to_json(obj: dict) -> str:
    return json.dumps(obj, default=str, sort_keys=True)
