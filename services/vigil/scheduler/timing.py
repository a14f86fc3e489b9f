"""Pure timing rules of vigil's scheduler: when a timer fires, what it fires, and
when it is due next. No database, no Kafka, no clock: every function takes the
current instant as an argument so the rules can be tested exhaustively.

Time model
----------
* Instants are whole seconds since the Unix epoch (UTC). ``int`` only: a float
  would leak into event keys (``t@1700000000.0``) and break their idempotence.
* A timer is *due* when ``due <= now``.
* A timer recurs either every ``every`` seconds or by a 5-field cron expression
  (minute hour day-of-month month day-of-week) evaluated in the IANA zone
  ``tz``; a timer with neither is a one-off.
* Interval occurrences are the lattice ``due + k*every`` anchored on the
  timer's due time, never on "now", so a late tick does not shift later
  occurrences. Because ``plan`` only ever moves ``due`` along that lattice,
  anchoring on the stored due is the same as anchoring on the original one.
  ``tz`` is ignored for intervals: they count elapsed seconds.

Cron and daylight saving time (cronsim 2.8 behaviour, kept on purpose)
----------------------------------------------------------------------
* Expressions whose minute and hour fields are both fixed (neither starts
  with ``*``, e.g. ``30 2 * * *``) follow wall-clock time like Debian cron:
  - a wall time that does not exist (spring forward) fires at the first
    existing minute after it: ``30 2 * * *`` in America/New_York fires at
    03:00 EDT on 2026-03-08;
  - a wall time that happens twice (fall back) fires once, at its first
    (daylight-time) instance: ``30 1 * * *`` fires at 01:30 EDT on 2026-11-01
    and not again at 01:30 EST.
* Expressions with a wildcard or step in the minute or hour field (e.g.
  ``*/15 * * * *``) follow elapsed time: the repeated hour fires twice, the
  skipped hour not at all.
* Every occurrence is strictly later than the one before it. cronsim can
  yield the same instant twice (``0 2,3 * * *`` maps both 02:00 and 03:00 to
  03:00 EDT on spring-forward day) or an instant before its start (starting in
  the second 01:xx of fall-back day it restarts from the wall time); both are
  dropped here, which is what makes "fires once" hold.
* cronsim gives up when an expression has no match within 50 years; such a
  schedule is treated as finished (``next_due`` None).

Catch-up after an outage
------------------------
Let ``n`` be the number of occurrences with ``scheduled_for <= now`` (the
timer's due plus every later one). Each has ``late_by = now - scheduled_for``.
An occurrence is *on time* when ``late_by <= grace`` (``grace`` is the
scheduler's tick: lateness up to one tick is the scheduler's own polling, not
an outage), otherwise it is *missed*. On-time occurrences fire under every
policy. A policy picks a *window*; only occurrences with ``late_by <= window``
may fire:

* ``coalesce`` (default): window = unlimited. One event for the latest due
  occurrence, carrying ``skipped = n - 1``.
* ``each``: window = unlimited. One event per due occurrence, oldest first;
  at most ``each_cap`` of them, the *latest* ones, because those are the most
  relevant and firing them lets the timer reach the future in one step. The
  older ones are skipped (not deferred).
* ``skip``: window = ``grace``. The latest occurrence fires only if it is on
  time (with ``skipped = n - 1`` if the tick also passed over earlier ones);
  otherwise nothing fires. Never more than one event.
* ``max_lateness`` narrows the window of coalesce/each to
  ``max(max_lateness, grace)``: an occurrence with
  ``late_by > max_lateness`` becomes a skip, except that it never suppresses
  an on-time occurrence. A ``max_lateness`` below the tick would otherwise
  make firing depend on the tick's phase. Pass ``grace=0`` for the bare rule.

The fired events are always the latest contiguous run of due occurrences, so
everything passed over precedes them: the first fired event carries
``skipped`` = all passed-over occurrences, later ones carry 0, and
``Plan.skipped_total`` is the same number. A one-off that fires nothing (skip
policy and missed, or older than max_lateness) is ``marked_skipped``.

Cost bounds
-----------
Intervals are counted with arithmetic. Cron occurrences are counted by
walking them, at most ``CRON_SCAN_LIMIT`` (10,000) per plan. Past that the
stretch up to now is not walked: the latest occurrences are found by
bisection (about log2(seconds) cronsim calls each), the count becomes a lower
bound and ``Plan.skipped_is_lower_bound`` says so. Only minute-level crons
after roughly a week of outage reach the limit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

CATCH_UP_POLICIES = ("coalesce", "each", "skip")
DEFAULT_GRACE = 60
DEFAULT_EACH_CAP = 100
CRON_SCAN_LIMIT = 10_000

_CRON_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
_CRON_FIELD_HELP = {
    "minute": "0-59",
    "hour": "0-23",
    "day-of-month": "1-31, L or LW",
    "month": "1-12 or JAN-DEC",
    "day-of-week": "0-7 or SUN-SAT (0 and 7 are Sunday), also 5L or MON#2",
}
# Both resolve through the host's configuration rather than a named zone, so
# the same timer would fire at different instants on different machines.
_HOST_DEPENDENT_ZONES = frozenset({"localtime", "posixrules"})


# --- data -------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """Fixed-interval recurrence: occurrences are ``anchor + k*every``, k >= 0."""

    every: int
    anchor: int


@dataclass(frozen=True)
class Cron:
    """Cron recurrence: a 5-field expression evaluated in IANA zone ``tz``."""

    expr: str
    tz: str = "UTC"


Recurrence = Interval | Cron


@dataclass(frozen=True)
class TimerSpec:
    """The timing-relevant part of a timer.

    ``every`` and ``cron`` are mutually exclusive; with neither, the timer is
    a one-off. Construction validates everything, so ``plan`` cannot fail on
    a spec that exists.
    """

    due: int
    every: int | None = None
    cron: str | None = None
    tz: str = "UTC"
    catch_up: str = "coalesce"
    max_lateness: int | None = None

    def __post_init__(self) -> None:
        _require_int("due", self.due)
        if self.every is not None:
            _require_int("every", self.every)
            if self.every <= 0:
                raise ValueError(f"every must be a positive number of seconds, got {self.every}")
        if self.every is not None and self.cron is not None:
            raise ValueError("a timer recurs by every or by cron, not both")
        if self.catch_up not in CATCH_UP_POLICIES:
            raise ValueError(f"catch_up must be one of {', '.join(CATCH_UP_POLICIES)}, got {self.catch_up!r}")
        if self.max_lateness is not None:
            _require_int("max_lateness", self.max_lateness)
            if self.max_lateness < 0:
                raise ValueError(f"max_lateness must be >= 0 seconds, got {self.max_lateness}")
        zone = validate_tz(self.tz)
        if self.cron is not None:
            # Parse only: a schedule that has run out is a finished timer, not
            # a broken row, so the 50-year probe belongs to the API alone.
            _parse_cron(self.cron, zone)

    @property
    def recurrence(self) -> Recurrence | None:
        if self.every is not None:
            return Interval(self.every, self.due)
        if self.cron is not None:
            return Cron(self.cron, self.tz)
        return None


@dataclass(frozen=True)
class Occurrence:
    """One event to produce. ``skipped`` = occurrences this event passed over."""

    scheduled_for: int
    late_by: int
    skipped: int = 0


@dataclass(frozen=True)
class Plan:
    """What the scheduler does with one timer at one instant.

    ``fire`` is oldest first. ``next_due`` None means the timer is finished
    (one-off consumed, or a cron schedule that never matches again);
    ``finished`` is that same fact spelled out. ``marked_skipped`` is set when
    a one-off finishes without firing.
    """

    fire: tuple[Occurrence, ...]
    skipped_total: int
    next_due: int | None
    finished: bool
    marked_skipped: bool = False
    skipped_is_lower_bound: bool = False


# --- validation -------------------------------------------------------------


def validate_tz(tz: str) -> ZoneInfo:
    """Return the zone for IANA name ``tz``; ValueError with the reason if none."""
    if not isinstance(tz, str) or not tz:
        raise ValueError("time zone is empty: use an IANA name such as 'Europe/Berlin' or 'UTC'")
    if tz in _HOST_DEPENDENT_ZONES:
        raise ValueError(
            f"time zone {tz!r} depends on the server's configuration: use an IANA name such as 'America/New_York'"
        )
    try:
        return ZoneInfo(tz)
    except ZoneInfoNotFoundError:
        raise ValueError(
            f"unknown time zone {tz!r}: use an IANA name such as 'America/New_York' (names are case-sensitive)"
        ) from None
    except (ValueError, OSError) as exc:
        raise ValueError(f"invalid time zone {tz!r}: {exc}") from None


def validate_cron(expr: str, tz: str = "UTC") -> None:
    """Accept a 5-field cron expression in zone ``tz`` or raise ValueError why.

    Besides syntax, rejects expressions that never match within 50 years from
    now (cronsim's horizon), since such a timer could never fire.
    """
    zone = validate_tz(tz)
    _parse_cron(expr, zone)
    if next_occurrence(Cron(expr, tz), int(time.time())) is None:
        raise ValueError(f"cron expression {expr!r} never matches within the next 50 years")


def _parse_cron(expr: str, zone: ZoneInfo) -> None:
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError("cron expression is empty")
    fields = expr.split()
    if len(fields) != 5:
        # cronsim would also take a 6-field (seconds) form; timers have
        # whole-minute schedules and the DST rules above hold for 5 fields only.
        raise ValueError(
            f"cron expression {expr!r} has {len(fields)} field(s); expected 5: "
            "minute hour day-of-month month day-of-week"
        )
    try:
        CronSim(expr, datetime.fromtimestamp(0, zone))
    except CronSimError as exc:
        raise ValueError(_explain_cron_error(expr, fields, str(exc))) from None
    except Exception as exc:  # cronsim signals a few malformed inputs by accident
        raise ValueError(f"cron expression {expr!r} could not be parsed: {exc}") from None


def _explain_cron_error(expr: str, fields: list[str], message: str) -> str:
    name = message.removeprefix("Bad ").strip()
    if name in _CRON_FIELDS:
        value = fields[_CRON_FIELDS.index(name)]
        return (
            f"bad {name} field {value!r} in cron expression {expr!r}: allowed are "
            f"{_CRON_FIELD_HELP[name]}, with lists (a,b), ranges (a-b) and steps (*/n, a-b/n)"
        )
    return f"bad cron expression {expr!r}: {message}"


def _require_int(name: str, value: object) -> None:
    # bool is an int subclass; True as a due time is a bug, not second 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be whole epoch seconds (int), got {value!r}")


# --- occurrences ------------------------------------------------------------


def interval_due_count(due: int, every: int, now: int) -> int:
    """Occurrences of ``due + k*every`` (k >= 0) that are ``<= now``, in O(1)."""
    if due > now:
        return 0
    return (now - due) // every + 1


def next_occurrence(recurrence: Recurrence | None, after_epoch: int) -> int | None:
    """First occurrence strictly after ``after_epoch``; None if there is none.

    None for a one-off (``recurrence`` None) and for a cron expression with no
    match in the next 50 years. Interval: the smallest ``anchor + k*every``
    (k >= 0) above ``after_epoch``, so ``anchor`` itself when it is later.
    """
    _require_int("after_epoch", after_epoch)
    if recurrence is None:
        return None
    if isinstance(recurrence, Interval):
        return (
            recurrence.anchor + interval_due_count(recurrence.anchor, recurrence.every, after_epoch) * recurrence.every
        )
    if isinstance(recurrence, Cron):
        return next(_cron_after(recurrence.expr, validate_tz(recurrence.tz), after_epoch), None)
    raise TypeError(f"not a recurrence: {recurrence!r}")


def _cron_after(expr: str, zone: ZoneInfo, after: int) -> Iterator[int]:
    """Strictly increasing cron occurrences after ``after`` (see module notes)."""
    last = after
    # timestamp() honours fold; comparing aware datetimes in one zone would not.
    for moment in CronSim(expr, datetime.fromtimestamp(after, zone)):
        instant = int(moment.timestamp())
        if instant > last:
            last = instant
            yield instant


def _cron_before(expr: str, zone: ZoneInfo, before: int, floor: int) -> int | None:
    """Latest cron occurrence in the open interval (floor, before), by bisection.

    Relies on next-after(s) never decreasing as s grows: find the largest s
    in [floor, before) whose next occurrence is still below ``before``.
    """

    def after(s: int) -> int | None:
        return next(_cron_after(expr, zone, s), None)

    first = after(floor)
    if first is None or first >= before:
        return None
    lo, hi = floor, before - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        candidate = after(mid)
        if candidate is not None and candidate < before:
            lo = mid
        else:
            hi = mid - 1
    return after(lo)


@dataclass(frozen=True)
class _Due:
    count: int  # occurrences <= now (a lower bound if ``count_is_lower_bound``)
    latest: tuple[int, ...]  # the latest ``keep`` of them, oldest first
    next_due: int | None
    count_is_lower_bound: bool = False


def _due_interval(spec: TimerSpec, now: int, keep: int) -> _Due:
    every = spec.every
    assert every is not None
    n = interval_due_count(spec.due, every, now)
    first_kept = max(0, n - keep)
    return _Due(
        count=n,
        latest=tuple(spec.due + k * every for k in range(first_kept, n)),
        next_due=spec.due + n * every,
    )


def _due_cron(spec: TimerSpec, now: int, keep: int, window: float) -> _Due:
    assert spec.cron is not None
    zone = validate_tz(spec.tz)
    # The stored due is occurrence #1 even if it was not itself a cron match
    # (e.g. a first run set by hand); the schedule continues from it.
    latest: deque[int] = deque([spec.due], maxlen=keep)
    count = 1
    walk = _cron_after(spec.cron, zone, spec.due)
    for instant in walk:
        if instant > now:
            return _Due(count, tuple(latest), instant)
        count += 1
        latest.append(instant)
        if count >= CRON_SCAN_LIMIT:
            break
    else:
        return _Due(count, tuple(latest), None)

    # Scan limit reached: nothing between latest[-1] and now has been counted.
    # Fetch the newest occurrences backwards; stop early once they are too old
    # to fire, since older ones would only be counted, and counting is what
    # the limit forbids.
    walked_to = latest[-1]
    tail: list[int] = []
    upper = now + 1
    exhausted = False
    while len(tail) < keep:
        previous = _cron_before(spec.cron, zone, upper, walked_to)
        if previous is None:
            exhausted = True
            break
        tail.append(previous)
        upper = previous
        if now - previous > window:
            break
    tail.reverse()
    latest.extend(tail)
    return _Due(
        count=count + len(tail),
        latest=tuple(latest),
        next_due=next(_cron_after(spec.cron, zone, now), None),
        count_is_lower_bound=not exhausted,
    )


# --- planning ---------------------------------------------------------------


def plan(
    timer_spec: TimerSpec,
    now_epoch: int,
    grace: int = DEFAULT_GRACE,
    each_cap: int = DEFAULT_EACH_CAP,
) -> Plan:
    """Decide what ``timer_spec`` fires at ``now_epoch`` and when it is due next.

    Rules are in the module docstring. A timer that is not yet due yields an
    empty plan with ``next_due`` unchanged. For a recurring timer ``next_due``
    is always the first occurrence strictly after ``now_epoch``, so applying
    the plan can never make the same occurrence due twice.
    """
    spec = timer_spec
    _require_int("now_epoch", now_epoch)
    _require_int("grace", grace)
    _require_int("each_cap", each_cap)
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    if each_cap < 1:
        raise ValueError(f"each_cap must be >= 1, got {each_cap}")
    now = now_epoch

    if spec.due > now:
        return Plan(fire=(), skipped_total=0, next_due=spec.due, finished=False)

    window: float
    if spec.catch_up == "skip":
        window = grace
    elif spec.max_lateness is not None:
        window = max(spec.max_lateness, grace)
    else:
        window = float("inf")
    keep = each_cap if spec.catch_up == "each" else 1

    if spec.every is not None:
        due = _due_interval(spec, now, keep)
    elif spec.cron is not None:
        due = _due_cron(spec, now, keep, window)
    else:
        due = _Due(count=1, latest=(spec.due,), next_due=None)

    # Eligible occurrences form a suffix of ``latest``: later means less late.
    eligible = [t for t in due.latest if now - t <= window][-keep:]
    skipped_total = due.count - len(eligible)
    fire = tuple(
        Occurrence(scheduled_for=t, late_by=now - t, skipped=skipped_total if i == 0 else 0)
        for i, t in enumerate(eligible)
    )
    one_off = spec.every is None and spec.cron is None
    return Plan(
        fire=fire,
        skipped_total=skipped_total,
        next_due=due.next_due,
        finished=due.next_due is None,
        marked_skipped=one_off and not fire,
        skipped_is_lower_bound=due.count_is_lower_bound,
    )


def event_key(timer_id: object, scheduled_for: int) -> str:
    """Idempotence key of one occurrence: ``"<timer id>@<epoch seconds>"``.

    The same occurrence always gets the same key, so a re-planned tick after
    a crash produces duplicates the consumers can drop.
    """
    _require_int("scheduled_for", scheduled_for)
    return f"{timer_id}@{scheduled_for}"
