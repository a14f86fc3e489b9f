"""The dispatcher's ledger side: the claim that fixes deliveries, and the recorded outcomes.

The claim is one transaction, in this order:

1. lock the ``users`` rows of users who may have something due (``FOR UPDATE SKIP LOCKED``:
   another dispatcher's users are skipped, never waited for), looking at users in user_id
   order after the previous pass's cursor: a round robin, so a pass costs what it claims,
   not the whole backlog, and every due user gets its turn within one sweep; or, between
   sweeps, only at users with rows written after a given outbox id and those whose delivery
   just ended;
   (on a shard other than the catalog, their channels are read from the catalog here: its
   ``channels`` table is the only one; a catalog that does not answer fails the claim, which
   rolls back, rather than send anyone's messages to the log channel);
2. read those users' unfinished outbox rows (a statement that starts after the locks are
   held, so it sees everything the previous holder committed);
3. :func:`vigil.dispatcher.pacing.plan` decides per user;
4. fix a new delivery id on held rows and restart the user's gap, re-arm retries and lost
   sends under their own ids, bury deliveries out of attempts: each one statement that
   checks the state it expects;
5. commit. Only then is anything sent.

A crash before 5 leaves nothing (the locks go with the connection). A crash after it leaves
rows ``sending`` under a lease: once it passes, a dispatcher sends them again with the same
delivery id, which is what makes the send/commit gap harmless to an idempotent receiver.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from uuid import UUID

import psycopg
from psycopg.rows import DictRow

from vigil.dispatcher import metrics
from vigil.dispatcher.channels import LOG_CHANNEL, ChannelConfig, Delivery
from vigil.dispatcher.pacing import MAX_MESSAGES_PER_DELIVERY, Action, Decision, Pacing, Row, plan, wake_at
from vigil.errors import VigilError
from vigil.ledger import outbox
from vigil.ledger.channels import ChannelRow
from vigil.ledger.outbox import DueUser
from vigil.ledger.states import ChannelType

log = logging.getLogger(__name__)


class ClaimConflict(VigilError):
    """A row changed under the claim's user lock: the transaction is rolled back."""


@dataclass(frozen=True, slots=True)
class Limits:
    default_gap_s: int
    default_urgent_cap: int
    max_attempts: int
    lease_s: float
    batch_users: int
    max_messages: int = MAX_MESSAGES_PER_DELIVERY
    attention: outbox.Attention = outbox.Attention()  # how each user's earned gap adapts
    fresh_max: int = 10_000  # outbox ids one claim between sweeps looks at (more: sweep)


@dataclass
class Claimed:
    deliveries: list[Delivery] = field(default_factory=list)
    buried: list[Delivery] = field(default_factory=list)  # out of attempts with no outcome: now dead
    lost: list[Delivery] = field(default_factory=list)  # re-armed after their lease ran out
    bypasses: int = 0  # new deliveries inside the gap because of an urgent message
    users_locked: int = 0
    cursor: str = ""  # where the next claim's sweep starts ('' from the first user)
    high: int = 0  # the outbox's highest id this claim could see
    # Users looked at whose messages are not due yet, with when that may change: the loop
    # looks at them again then instead of waiting for the next sweep.
    waits: list[tuple[str, datetime]] = field(default_factory=list)
    # Outbox ids looked at between sweeps with no row yet (a transaction still open): the next
    # claim looks at them again.
    missing: list[int] = field(default_factory=list)


def _config(row: DueUser) -> ChannelConfig:
    if row.type is None:
        return LOG_CHANNEL
    return ChannelConfig(ChannelType(row.type), row.url, row.secret, row.gap_seconds, row.urgent_daily_cap)


def _with_catalogs_channel(row: DueUser, channel: ChannelRow | None) -> DueUser:
    """The locked user with the channel the catalog holds for them (None: the log channel)."""
    if channel is None:
        return replace(row, type=None, url=None, secret=None, gap_seconds=None, urgent_daily_cap=None)
    return replace(
        row,
        type=channel.type,
        url=channel.url,
        secret=channel.secret,
        gap_seconds=channel.gap_seconds,
        urgent_daily_cap=channel.urgent_daily_cap,
    )


def _pacing(row: DueUser, config: ChannelConfig, limits: Limits) -> Pacing:
    return Pacing(
        user_id=row.user_id,
        last_delivery_at=row.last_delivery_at,
        urgent_day=row.urgent_day,
        urgent_count=row.urgent_count,
        gap_s=next(g for g in (config.gap_s, row.attention_gap_s, limits.default_gap_s) if g is not None),
        urgent_cap=limits.default_urgent_cap if config.urgent_cap is None else config.urgent_cap,
    )


def _expect(what: str, returned: set, planned: set) -> None:
    if returned != planned:
        raise ClaimConflict(f"{what}: planned {len(planned)} rows, the ledger moved {len(returned)}")


def claim(
    conn: psycopg.Connection[DictRow],
    now: datetime,
    limits: Limits,
    after: str = "",
    fresh_after: int | None = None,
    recheck: list[str] | None = None,
    gaps: list[int] | None = None,
    catalog: Callable[[list[str]], Mapping[str, ChannelRow]] | None = None,
) -> Claimed:
    """Fix what is due now among the users after ``after`` (or, given ``fresh_after``, among
    the users with unfinished rows of a higher id or an id in ``gaps``, and those in
    ``recheck``) and commit;
    returns the deliveries to send and the next claim's cursor (see the module doc).
    ``catalog``, on a shard other than the catalog: the locked users' channels from it."""
    claimed = Claimed()
    lease_until = now + timedelta(seconds=limits.lease_s)
    with conn.transaction():
        due = outbox.lock_due_users(
            conn,
            now=now,
            default_gap_s=limits.default_gap_s,
            limit=limits.batch_users,
            after=after,
            fresh_after=fresh_after,
            fresh_max=limits.fresh_max,
            recheck=recheck,
            gaps=gaps,
        )
        claimed.cursor = due.cursor
        claimed.high = due.high
        claimed.waits = list(due.waits)
        claimed.missing = due.missing
        locked = due.users
        claimed.users_locked = len(locked)
        if not locked:
            return claimed
        if catalog is not None:
            channels = catalog([row.user_id for row in locked])
            locked = [_with_catalogs_channel(row, channels.get(row.user_id)) for row in locked]
        configs = {row.user_id: _config(row) for row in locked}
        pacings = {row.user_id: _pacing(row, configs[row.user_id], limits) for row in locked}
        rows: dict[str, list[Row]] = {user: [] for user in configs}
        for row in outbox.unfinished_for_users(conn, list(configs), limits.max_messages):
            rows[row.user_id].append(row)
        decisions = [plan(pacings[user], rows[user], now, limits.max_attempts, limits.max_messages) for user in configs]
        decided = [d for d in decisions if d is not None]
        for user, decision in zip(configs, decisions, strict=True):
            if decision is None and (at := wake_at(pacings[user], rows[user], now)) is not None:
                claimed.waits.append((user, at))
        _fix_new(
            conn, [d for d in decided if d.action is Action.NEW], configs, pacings, now, lease_until, claimed, limits
        )
        _rearm(conn, [d for d in decided if d.action is Action.RETRY], configs, now, lease_until, claimed)
        _bury(conn, [d for d in decided if d.action is Action.BURY], configs, now, claimed)
    return claimed


def _fix_new(conn, new: list[Decision], configs, pacings, now, lease_until, claimed: Claimed, limits: Limits) -> None:
    if not new:
        return
    ids: dict[str, UUID] = {d.user_id: uuid.uuid4() for d in new}
    row_ids = [row.id for d in new for row in d.rows]
    fixed = outbox.fix_deliveries(
        conn,
        now=now,
        lease_until=lease_until,
        ids=row_ids,
        delivery_ids=[ids[d.user_id] for d in new for _ in d.rows],
        channels=[configs[d.user_id].type.value for d in new for _ in d.rows],
    )
    _expect("fix deliveries", fixed, set(row_ids))
    paced = outbox.record_pacing(
        conn,
        now,
        [d.user_id for d in new],
        [pacings[d.user_id].last_delivery_at for d in new],
        [d.bypass for d in new],
        limits.attention,
    )
    _expect("record pacing", set(paced), {d.user_id for d in new})
    attention_metrics(paced.values(), now)
    for d in new:
        claimed.deliveries.append(Delivery(ids[d.user_id], d.user_id, d.rows, 1, now, configs[d.user_id]))
    claimed.bypasses += sum(1 for d in new if d.bypass)


def attention_metrics(paced: Iterable[outbox.Paced], now: datetime) -> None:
    """Reply rate and messages per user per day, without a user label: a user's day count is
    observed when their first delivery of a later day replaces it."""
    for p in paced:
        if p.replied is not None:
            metrics.ATTENTION_OUTCOMES.labels("replied" if p.replied else "unanswered").inc()
        if p.previous_day is not None and p.previous_day != now.date():
            metrics.DELIVERIES_PER_USER_DAY.observe(p.previous_day_count)


def _delivery(d: Decision, config: ChannelConfig, attempt: int) -> Delivery:
    head = d.rows[0]
    assert d.delivery_id is not None and head.fixed_at is not None
    return Delivery(d.delivery_id, d.user_id, d.rows, attempt, head.fixed_at, config)


def _rearm(conn, retries: list[Decision], configs, now, lease_until, claimed: Claimed) -> None:
    if not retries:
        return
    returned = outbox.claim_retries(
        conn,
        now=now,
        lease_until=lease_until,
        delivery_ids=[d.delivery_id for d in retries],  # type: ignore[misc]
        channels=[configs[d.user_id].type.value for d in retries],
    )
    _expect("re-arm retries", returned, {row.id for d in retries for row in d.rows})
    for d in retries:
        delivery = _delivery(d, configs[d.user_id], d.rows[0].attempts + 1)
        claimed.deliveries.append(delivery)
        if d.lost:
            claimed.lost.append(delivery)


def _bury(conn, buried: list[Decision], configs, now, claimed: Claimed) -> None:
    if not buried:
        return
    returned = outbox.bury_lost(conn, now, [d.delivery_id for d in buried])  # type: ignore[misc]
    _expect("bury lost deliveries", returned, {row.id for d in buried for row in d.rows})
    for d in buried:
        delivery = _delivery(d, configs[d.user_id], d.rows[0].attempts)
        claimed.buried.append(delivery)
        log.warning(
            "delivery %s to %s is dead: no outcome after %d attempts", d.delivery_id, d.user_id, delivery.attempt
        )


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the ledger now says about an attempt. ``stood`` False: the attempt was superseded."""

    stood: bool
    created_at: list[datetime] = field(default_factory=list)  # delivered rows' creation times


def record_delivered(conn: psycopg.Connection[DictRow], deliveries: list[Delivery], now: datetime) -> list[Recorded]:
    """The accepted deliveries' outcomes in one statement (one commit), in their order."""
    created = outbox.mark_delivered(conn, {d.delivery_id: d.attempt for d in deliveries}, now)
    return [Recorded(bool(created[d.delivery_id]), created[d.delivery_id]) for d in deliveries]


def record_retry(conn: psycopg.Connection[DictRow], delivery: Delivery, at: datetime, error: str) -> Recorded:
    return Recorded(outbox.schedule_retry(conn, delivery.delivery_id, delivery.attempt, at, error) > 0)


def record_dead(conn: psycopg.Connection[DictRow], delivery: Delivery, now: datetime, error: str) -> Recorded:
    return Recorded(outbox.mark_dead(conn, delivery.delivery_id, delivery.attempt, now, error) > 0)
