"""The pacing rule and the retry schedule, as pure functions of the ledger's state.

The claim (:mod:`vigil.dispatcher.claims`) locks a user's ``users`` row, reads the user's
unfinished outbox rows, and asks :func:`plan` what to do; nothing here touches the database,
so every rule is tested without one. What :func:`plan` decides for one user:

1. The user has a delivery whose id is already fixed and not finished (a retry waiting out
   its backoff, or a send in flight): nothing new starts before it ends, so messages reach
   the person in the order they were written. Once its ``next_attempt_at`` passes it is sent
   again under the same id; if it already used its last attempt, it is dead.
2. Otherwise, held messages (pending, no delivery id) go out together, oldest first, when
   the user's gap has passed since their last delivery.
3. Inside the gap, an urgent held message takes everything held with it at once (order kept,
   and the gap restarts), unless the user's urgent bypasses for the day are used up; then it
   waits like any other message. A message with a deadline (an approval question) is never
   held by the cap: waiting out the gap could deliver a question that has already expired.
   It still counts against the cap.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta
from enum import StrEnum
from uuid import UUID

from vigil.ledger.outbox import UnfinishedRow
from vigil.ledger.states import OutboxStatus
from vigil.retry import backoff

# Joined messages per delivery. A user with more held than this gets the oldest now and the
# rest one gap later: a receiver's request size stays bounded whatever the agent wrote.
MAX_MESSAGES_PER_DELIVERY = 100
# Spread retries of many deliveries that failed together (a receiver's outage) so they do
# not return as one burst.
BACKOFF_JITTER = 0.1
# A Retry-After beyond a day is a misconfigured receiver, not a plan.
RETRY_AFTER_MAX_S = 86_400.0


# An unfinished outbox row (pending or sending) as the claim reads it: the ledger's row type.
Row = UnfinishedRow


@dataclass(frozen=True, slots=True)
class Pacing:
    """A user's pacing state (``users``, locked) and limits (``channels`` or the defaults)."""

    user_id: str
    last_delivery_at: datetime | None
    urgent_day: date | None
    urgent_count: int
    gap_s: int
    urgent_cap: int


class Action(StrEnum):
    NEW = "new"  # fix a delivery id on held rows and send them
    RETRY = "retry"  # send a fixed delivery again, same id
    BURY = "bury"  # a fixed delivery used its last attempt without an outcome: dead


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    user_id: str
    rows: tuple[Row, ...]
    delivery_id: UUID | None = None  # set for RETRY and BURY; NEW gets its id from the claim
    bypass: bool = False  # NEW inside the gap because of an urgent message (counts against the cap)
    lost: bool = False  # RETRY/BURY of a send whose dispatcher vanished (its lease ran out)


def urgent_used(pacing: Pacing, today: date) -> int:
    return pacing.urgent_count if pacing.urgent_day == today else 0


def gap_passed(pacing: Pacing, now: datetime) -> bool:
    last = pacing.last_delivery_at
    return last is None or now - last >= timedelta(seconds=pacing.gap_s)


def plan(
    pacing: Pacing,
    rows: list[Row],
    now: datetime,
    max_attempts: int,
    max_messages: int = MAX_MESSAGES_PER_DELIVERY,
) -> Decision | None:
    """What to send to one user now, or None (hold). ``rows``: the user's unfinished rows."""
    fixed = sorted((r for r in rows if r.delivery_id is not None), key=lambda r: r.id)
    if fixed:
        # One delivery in flight per user; should a second ever exist, the oldest goes first.
        first = fixed[0].delivery_id
        delivery = tuple(r for r in fixed if r.delivery_id == first)
        head = delivery[0]
        if head.next_attempt_at is not None and head.next_attempt_at > now:
            return None
        lost = head.status == OutboxStatus.SENDING
        action = Action.BURY if head.attempts >= max_attempts else Action.RETRY
        return Decision(action, pacing.user_id, delivery, delivery_id=first, lost=lost)
    held = sorted((r for r in rows if r.status == OutboxStatus.PENDING), key=lambda r: r.id)[:max_messages]
    if not held:
        return None
    if gap_passed(pacing, now):
        return Decision(Action.NEW, pacing.user_id, tuple(held))
    if any(r.urgent for r in held) and (
        urgent_used(pacing, now.date()) < pacing.urgent_cap or any(r.deadline is not None for r in held)
    ):
        return Decision(Action.NEW, pacing.user_id, tuple(held), bypass=True)
    return None


def wake_at(pacing: Pacing, rows: list[Row], now: datetime) -> datetime | None:
    """When :func:`plan`, which said hold at ``now``, may say something else (None: nothing
    left to send): the fixed delivery's backoff or lease end; otherwise the end of the gap, or
    the next day's start (a new urgent cap) if an urgent message is held."""
    fixed = [r.next_attempt_at for r in rows if r.delivery_id is not None and r.next_attempt_at is not None]
    if fixed:
        return min(fixed)
    held = [r for r in rows if r.status == OutboxStatus.PENDING and r.delivery_id is None]
    if not held:
        return None
    last = pacing.last_delivery_at or now
    at = last + timedelta(seconds=pacing.gap_s)
    if any(r.urgent for r in held):
        at = min(at, datetime.combine(now.date() + timedelta(days=1), time(), tzinfo=now.tzinfo))
    return at


def retry_delay(
    attempt: int,
    base_s: float,
    cap_s: float,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    :func:`vigil.retry.backoff` with the dispatcher's jitter: exponential from ``base_s``,
    stretched by up to 10 %, never past ``cap_s``. A receiver's Retry-After is honoured even
    past the cap (asking again sooner only earns another 429), up to a day.
    """
    return backoff(
        attempt,
        base_s,
        cap_s,
        jitter=(1.0, 1.0 + BACKOFF_JITTER),
        retry_after_s=retry_after_s,
        retry_after_max_s=RETRY_AFTER_MAX_S,
        rng=rng,
    )
