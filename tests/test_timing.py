"""The scheduler's pure timing rules (vigil.scheduler.timing).

Expected DST instants are worked out by hand from the US rules, not from
zoneinfo: in 2026 America/New_York is EST (UTC-5) until 02:00 local on Sunday
March 8, EDT (UTC-4) until 02:00 local on Sunday November 1, EST after.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

try:
    import vigil  # noqa: F401
except ImportError:  # not installed into the venv: run from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services"))

from vigil.scheduler import timing
from vigil.scheduler.timing import (
    Cron,
    Interval,
    Occurrence,
    Plan,
    TimerSpec,
    event_key,
    interval_due_count,
    next_occurrence,
    plan,
    validate_cron,
    validate_tz,
)

DAY = 86_400
NY = "America/New_York"


def utc(*fields: int) -> int:
    return int(datetime(*fields, tzinfo=UTC).timestamp())


T0 = utc(2026, 1, 5, 9, 0)


# --- the seed outage: daily timer, down for three occurrences + ten minutes ---

OUTAGE_NOW = T0 + 3 * DAY + 600


def test_seed_outage_coalesce_fires_latest_once() -> None:
    result = plan(TimerSpec(due=T0, every=DAY), OUTAGE_NOW)
    assert result.fire == (Occurrence(scheduled_for=T0 + 3 * DAY, late_by=600, skipped=3),)
    assert result.skipped_total == 3
    assert result.next_due == T0 + 4 * DAY
    assert result.next_due - OUTAGE_NOW == DAY - 600  # 23h50m: the next future occurrence
    assert not result.finished and not result.marked_skipped


def test_seed_outage_each_fires_every_occurrence() -> None:
    result = plan(TimerSpec(due=T0, every=DAY, catch_up="each"), OUTAGE_NOW)
    assert [o.scheduled_for for o in result.fire] == [T0, T0 + DAY, T0 + 2 * DAY, T0 + 3 * DAY]
    assert [o.late_by for o in result.fire] == [3 * DAY + 600, 2 * DAY + 600, DAY + 600, 600]
    assert all(o.skipped == 0 for o in result.fire)
    assert result.skipped_total == 0
    assert result.next_due == T0 + 4 * DAY


def test_seed_outage_skip_fires_nothing() -> None:
    result = plan(TimerSpec(due=T0, every=DAY, catch_up="skip"), OUTAGE_NOW)
    assert result.fire == ()
    assert result.skipped_total == 4
    assert result.next_due == T0 + 4 * DAY > OUTAGE_NOW
    assert not result.marked_skipped  # only one-offs are marked


def test_seed_outage_with_cron_in_a_zone() -> None:
    # 09:00 EST = 14:00 UTC on January days.
    due = utc(2026, 1, 5, 14, 0)
    spec = TimerSpec(due=due, cron="0 9 * * *", tz=NY)
    result = plan(spec, due + 3 * DAY + 600)
    assert result.fire == (Occurrence(due + 3 * DAY, 600, 3),)
    assert result.next_due == due + 4 * DAY


# --- on time, grace, and the skip policy ---


@pytest.mark.parametrize("policy", ["coalesce", "each", "skip"])
def test_on_time_occurrence_fires_under_every_policy(policy: str) -> None:
    result = plan(TimerSpec(due=T0, every=3600, catch_up=policy), T0 + 5)
    assert result.fire == (Occurrence(T0, 5, 0),)
    assert result.skipped_total == 0
    assert result.next_due == T0 + 3600


def test_skip_fires_within_grace_and_not_after() -> None:
    spec = TimerSpec(due=T0, every=3600, catch_up="skip")
    assert plan(spec, T0 + 60).fire == (Occurrence(T0, 60, 0),)
    assert plan(spec, T0 + 61).fire == ()
    assert plan(spec, T0 + 61, grace=120).fire == (Occurrence(T0, 61, 0),)


def test_skip_with_interval_shorter_than_tick_fires_latest_once() -> None:
    # 1000, 1020, 1040, 1060 are due at 1070: only 1060 is within the tick.
    result = plan(TimerSpec(due=1000, every=20, catch_up="skip"), 1070)
    assert result.fire == (Occurrence(1060, 10, 3),)
    assert result.skipped_total == 3
    assert result.next_due == 1080


def test_not_yet_due_is_an_empty_plan() -> None:
    result = plan(TimerSpec(due=T0, every=60), T0 - 1)
    assert result == Plan(fire=(), skipped_total=0, next_due=T0, finished=False)


# --- max_lateness ---


def test_max_lateness_turns_a_too_late_coalesce_into_a_skip() -> None:
    result = plan(TimerSpec(due=T0, every=DAY, max_lateness=300), OUTAGE_NOW)
    assert result.fire == ()
    assert result.skipped_total == 4
    assert result.next_due == T0 + 4 * DAY


def test_max_lateness_lets_a_recent_enough_coalesce_fire() -> None:
    result = plan(TimerSpec(due=T0, every=DAY, max_lateness=3600), OUTAGE_NOW)
    assert result.fire == (Occurrence(T0 + 3 * DAY, 600, 3),)


def test_max_lateness_with_each_keeps_only_recent_occurrences() -> None:
    # late_by == max_lateness is not "older than" it, so it still fires.
    spec = TimerSpec(due=T0, every=DAY, catch_up="each", max_lateness=DAY + 600)
    result = plan(spec, OUTAGE_NOW)
    assert result.fire == (Occurrence(T0 + 2 * DAY, DAY + 600, 2), Occurrence(T0 + 3 * DAY, 600, 0))
    assert result.skipped_total == 2


def test_max_lateness_below_the_tick_does_not_suppress_an_on_time_fire() -> None:
    spec = TimerSpec(due=T0, every=3600, max_lateness=10)
    assert plan(spec, T0 + 45).fire == (Occurrence(T0, 45, 0),)
    assert plan(spec, T0 + 61).fire == ()
    assert plan(spec, T0 + 45, grace=0).fire == ()  # the bare rule, on request


def test_one_off_older_than_max_lateness_is_marked_skipped() -> None:
    result = plan(TimerSpec(due=T0, max_lateness=600), T0 + 601)
    assert result.fire == ()
    assert result.marked_skipped and result.finished and result.next_due is None


# --- one-offs ---


@pytest.mark.parametrize("policy", ["coalesce", "each", "skip"])
def test_due_one_off_fires_and_finishes(policy: str) -> None:
    result = plan(TimerSpec(due=T0, catch_up=policy), T0 + 3)
    assert result.fire == (Occurrence(T0, 3, 0),)
    assert result.finished and result.next_due is None and not result.marked_skipped


def test_missed_one_off_with_skip_is_marked_skipped() -> None:
    result = plan(TimerSpec(due=T0, catch_up="skip"), T0 + 3600)
    assert result.fire == ()
    assert result.skipped_total == 1
    assert result.marked_skipped and result.finished and result.next_due is None


@pytest.mark.parametrize("policy", ["coalesce", "each"])
def test_missed_one_off_with_coalesce_or_each_fires_late(policy: str) -> None:
    result = plan(TimerSpec(due=T0, catch_up=policy), T0 + 3600)
    assert result.fire == (Occurrence(T0, 3600, 0),)
    assert result.finished and not result.marked_skipped


def test_pending_one_off_waits() -> None:
    result = plan(TimerSpec(due=T0), T0 - 10)
    assert result.fire == () and result.next_due == T0 and not result.finished


# --- intervals: anchoring and arithmetic counting ---


def test_interval_next_occurrence_is_anchored_and_strictly_after() -> None:
    rec = Interval(every=300, anchor=1_000)
    assert next_occurrence(rec, 0) == 1_000
    assert next_occurrence(rec, 999) == 1_000
    assert next_occurrence(rec, 1_000) == 1_300
    assert next_occurrence(rec, 1_299) == 1_300
    assert next_occurrence(rec, 1_300) == 1_600
    assert next_occurrence(rec, 1_000 + 300 * 1_000_000 + 7) == 1_000 + 300 * 1_000_001


def test_interval_count_is_arithmetic() -> None:
    assert interval_due_count(1_000, 300, 999) == 0
    assert interval_due_count(1_000, 300, 1_000) == 1
    assert interval_due_count(1_000, 300, 1_599) == 2
    # Twenty years of one-second occurrences: instant, since nothing iterates.
    assert interval_due_count(0, 1, 20 * 365 * DAY) == 20 * 365 * DAY + 1


def test_late_tick_does_not_shift_the_interval() -> None:
    result = plan(TimerSpec(due=1_000, every=300), 1_000 + 5 * 300 + 17)
    assert result.next_due == 1_000 + 6 * 300  # not now + 300


def test_interval_fires_each_occurrence_once_despite_jittery_ticks() -> None:
    due, fired = 1_000, []
    now = 990
    while now < 1_000 + 50 * 300:
        # Ticks drift 37 s at a time so they land all over the period.
        result = plan(TimerSpec(due=due, every=300), now)
        fired += [o.scheduled_for for o in result.fire]
        due = result.next_due
        now += 37
    assert fired == [1_000 + k * 300 for k in range(50)]


def test_each_cap_fires_the_latest_and_counts_the_rest_as_skipped() -> None:
    spec = TimerSpec(due=T0, every=60, catch_up="each")
    now = T0 + 999 * 60 + 5  # 1000 occurrences are due
    result = plan(spec, now, each_cap=100)
    assert [o.scheduled_for for o in result.fire] == [T0 + k * 60 for k in range(900, 1000)]
    assert result.fire[0].skipped == 900 and all(o.skipped == 0 for o in result.fire[1:])
    assert result.skipped_total == 900
    assert result.next_due == T0 + 1000 * 60


# --- cron across the 2026 DST changes in America/New_York ---


def series(expr: str, tz: str, start: int, count: int) -> list[int]:
    out, after = [], start
    for _ in range(count):
        after = next_occurrence(Cron(expr, tz), after)
        out.append(after)
    return out


def test_0230_daily_across_spring_forward() -> None:
    # 02:30 does not exist on Mar 8 (02:00 EST jumps to 03:00 EDT); cronsim
    # fires at the first existing minute after it, 03:00 EDT = 07:00 UTC.
    assert series("30 2 * * *", NY, utc(2026, 3, 7, 0, 0), 3) == [
        utc(2026, 3, 7, 7, 30),  # 02:30 EST
        utc(2026, 3, 8, 7, 0),  # 03:00 EDT, once
        utc(2026, 3, 9, 6, 30),  # 02:30 EDT
    ]


def test_0900_daily_across_spring_forward() -> None:
    assert series("0 9 * * *", NY, utc(2026, 3, 7, 0, 0), 3) == [
        utc(2026, 3, 7, 14, 0),  # 09:00 EST
        utc(2026, 3, 8, 13, 0),  # 09:00 EDT
        utc(2026, 3, 9, 13, 0),
    ]


def test_0230_daily_across_fall_back() -> None:
    # 02:30 on Nov 1 is after the repeated hour: plain 02:30 EST.
    assert series("30 2 * * *", NY, utc(2026, 10, 31, 0, 0), 3) == [
        utc(2026, 10, 31, 6, 30),  # 02:30 EDT
        utc(2026, 11, 1, 7, 30),  # 02:30 EST
        utc(2026, 11, 2, 7, 30),
    ]


def test_0900_daily_across_fall_back() -> None:
    assert series("0 9 * * *", NY, utc(2026, 10, 31, 0, 0), 3) == [
        utc(2026, 10, 31, 13, 0),  # 09:00 EDT
        utc(2026, 11, 1, 14, 0),  # 09:00 EST
        utc(2026, 11, 2, 14, 0),
    ]


def test_0130_fires_once_on_fall_back_day_at_the_first_0130() -> None:
    assert series("30 1 * * *", NY, utc(2026, 10, 31, 0, 0), 3) == [
        utc(2026, 10, 31, 5, 30),  # 01:30 EDT
        utc(2026, 11, 1, 5, 30),  # 01:30 EDT; 01:30 EST (06:30 UTC) does not fire
        utc(2026, 11, 2, 6, 30),  # 01:30 EST
    ]


def test_start_inside_the_repeated_hour_does_not_go_back_in_time() -> None:
    # 01:10 EST (06:10 UTC), after the first 01:30 already happened; cronsim
    # alone restarts from wall time 01:10 and would answer 01:30 EDT, the past.
    assert next_occurrence(Cron("30 1 * * *", NY), utc(2026, 11, 1, 6, 10)) == utc(2026, 11, 2, 6, 30)


def test_two_wall_times_folded_onto_one_instant_fire_once() -> None:
    # On Mar 8 both 02:00 (missing) and 03:00 land on 03:00 EDT = 07:00 UTC.
    assert series("0 2,3 * * *", NY, utc(2026, 3, 8, 0, 0), 3) == [
        utc(2026, 3, 8, 7, 0),
        utc(2026, 3, 9, 6, 0),  # 02:00 EDT
        utc(2026, 3, 9, 7, 0),  # 03:00 EDT
    ]


def test_stepped_minutes_follow_elapsed_time_through_the_repeated_hour() -> None:
    # */30 is not a fixed wall time: both 01:00 and both 01:30 fire.
    assert series("*/30 * * * *", NY, utc(2026, 11, 1, 4, 45), 5) == [
        utc(2026, 11, 1, 5, 0),  # 01:00 EDT
        utc(2026, 11, 1, 5, 30),  # 01:30 EDT
        utc(2026, 11, 1, 6, 0),  # 01:00 EST
        utc(2026, 11, 1, 6, 30),  # 01:30 EST
        utc(2026, 11, 1, 7, 0),  # 02:00 EST
    ]


@pytest.mark.parametrize(
    ("expr", "start", "end", "expected"),
    [
        ("30 2 * * *", utc(2026, 3, 7, 5, 0), utc(2026, 3, 9, 5, 0), [utc(2026, 3, 7, 7, 30), utc(2026, 3, 8, 7, 0)]),
        ("0 9 * * *", utc(2026, 3, 7, 5, 0), utc(2026, 3, 9, 5, 0), [utc(2026, 3, 7, 14, 0), utc(2026, 3, 8, 13, 0)]),
        (
            "30 1 * * *",
            utc(2026, 10, 31, 4, 0),
            utc(2026, 11, 2, 4, 0),
            [utc(2026, 10, 31, 5, 30), utc(2026, 11, 1, 5, 30)],
        ),
        (
            "30 2 * * *",
            utc(2026, 10, 31, 4, 0),
            utc(2026, 11, 2, 4, 0),
            [utc(2026, 10, 31, 6, 30), utc(2026, 11, 1, 7, 30)],
        ),
        (
            "0 9 * * *",
            utc(2026, 10, 31, 4, 0),
            utc(2026, 11, 2, 4, 0),
            [utc(2026, 10, 31, 13, 0), utc(2026, 11, 1, 14, 0)],
        ),
    ],
)
def test_scheduler_loop_fires_each_dst_day_occurrence_once(
    expr: str, start: int, end: int, expected: list[int]
) -> None:
    # Drive plan() the way the scheduler does, one 60 s tick at a time.
    due = next_occurrence(Cron(expr, NY), start)
    fired = []
    for now in range(start, end, 60):
        result = plan(TimerSpec(due=due, cron=expr, tz=NY), now)
        fired += [o.scheduled_for for o in result.fire]
        assert all(o.late_by < 60 for o in result.fire)
        due = result.next_due
    assert fired == expected


# --- cron catch-up and the scan limit ---


def test_cron_each_after_outage() -> None:
    due = utc(2026, 2, 1, 0, 0)
    result = plan(TimerSpec(due=due, cron="0 * * * *", catch_up="each"), due + 5 * 3600 + 120)
    assert [o.scheduled_for for o in result.fire] == [due + h * 3600 for h in range(6)]
    assert result.next_due == due + 6 * 3600


def test_rare_cron_is_found_decades_ahead() -> None:
    # A fifth Monday in February needs Feb 29 on a Monday: 2044, then 2072.
    spec = TimerSpec(due=utc(2044, 2, 29, 0, 0), cron="0 0 * 2 MON#5", tz="UTC")
    result = plan(spec, spec.due)
    assert result.fire == (Occurrence(spec.due, 0, 0),)
    assert result.next_due == utc(2072, 2, 29, 0, 0) and not result.finished


def test_minute_cron_after_a_long_outage_hits_the_scan_limit() -> None:
    due = utc(2026, 1, 1, 0, 0)
    now = due + 8 * DAY + 30  # 11,521 minutes are due: over the 10,000 walk
    coalesced = plan(TimerSpec(due=due, cron="* * * * *"), now)
    assert coalesced.fire == (Occurrence(due + 8 * DAY, 30, coalesced.skipped_total),)
    assert coalesced.skipped_is_lower_bound
    assert timing.CRON_SCAN_LIMIT <= coalesced.skipped_total < 8 * DAY // 60
    assert coalesced.next_due == due + 8 * DAY + 60

    each = plan(TimerSpec(due=due, cron="* * * * *", catch_up="each"), now)
    assert [o.scheduled_for for o in each.fire] == [due + 8 * DAY - k * 60 for k in range(99, -1, -1)]
    assert each.skipped_is_lower_bound


@pytest.mark.parametrize(
    ("expr", "tz", "outage"),
    [
        ("*/5 3 * * *", "UTC", 20 * DAY + 7),  # dense clumps, then long gaps
        ("0 9 * * MON-FRI", NY, 60 * DAY + 11),
        ("30 1,2 * * *", NY, 40 * DAY),  # spans the fall-back day
        ("15 */6 * * *", "Europe/Berlin", 30 * DAY + 900),
    ],
)
@pytest.mark.parametrize("policy", ["coalesce", "each"])
def test_bisection_past_the_scan_limit_agrees_with_the_full_walk(
    expr: str, tz: str, outage: int, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    due = next_occurrence(Cron(expr, tz), utc(2026, 10, 1, 0, 0))
    spec = TimerSpec(due=due, cron=expr, tz=tz, catch_up=policy)
    full = plan(spec, due + outage, each_cap=7)
    monkeypatch.setattr(timing, "CRON_SCAN_LIMIT", 5)
    bisected = plan(spec, due + outage, each_cap=7)
    assert [(o.scheduled_for, o.late_by) for o in bisected.fire] == [(o.scheduled_for, o.late_by) for o in full.fire]
    assert bisected.next_due == full.next_due
    assert not full.skipped_is_lower_bound and bisected.skipped_is_lower_bound
    assert bisected.skipped_total <= full.skipped_total


# --- validation ---


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("", "empty"),
        ("* * * *", "expected 5"),
        ("0 * * * * *", "expected 5"),  # seconds field: not accepted for timers
        ("61 * * * *", "minute field '61'"),
        ("0 24 * * *", "hour field '24'"),
        ("0 0 32 * *", "day-of-month field '32'"),
        ("0 0 30 2 *", "day-of-month field '30'"),  # February never has a 30th
        ("0 0 * 13 *", "month field '13'"),
        ("0 0 * * 8", "day-of-week field '8'"),
        ("*/0 * * * *", "minute field '*/0'"),
        ("5-1 * * * *", "minute field '5-1'"),
        ("0 9 * * FUNDAY", "day-of-week field 'FUNDAY'"),
        ("a b c d e", "minute field 'a'"),
    ],
)
def test_bad_cron_expressions_say_why(expr: str, reason: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate_cron(expr, "UTC")
    assert reason in str(caught.value)


@pytest.mark.parametrize(
    ("tz", "reason"),
    [
        ("", "empty"),
        ("Mars/Olympus", "unknown time zone 'Mars/Olympus'"),
        ("america/new_york", "case-sensitive"),
        ("America", "unknown time zone"),  # a directory of zones, not a zone
        ("/etc/passwd", "invalid time zone"),
        ("../etc/passwd", "invalid time zone"),
        ("localtime", "server's configuration"),
    ],
)
def test_bad_zones_say_why(tz: str, reason: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate_tz(tz)
    assert reason in str(caught.value)
    with pytest.raises(ValueError) as caught:
        validate_cron("0 9 * * *", tz)
    assert reason in str(caught.value)


@pytest.mark.parametrize("expr", ["0 9 * * *", "*/15 * * * *", "0 0 L * *", "0 9 * * MON#2", "0 0 29 2 *"])
def test_good_cron_expressions_pass(expr: str) -> None:
    validate_cron(expr, NY)


def test_timer_spec_rejects_contradictions() -> None:
    with pytest.raises(ValueError, match="not both"):
        TimerSpec(due=T0, every=60, cron="* * * * *")
    with pytest.raises(ValueError, match="catch_up"):
        TimerSpec(due=T0, catch_up="latest")
    with pytest.raises(ValueError, match="positive"):
        TimerSpec(due=T0, every=0)
    with pytest.raises(ValueError, match="max_lateness"):
        TimerSpec(due=T0, max_lateness=-1)
    with pytest.raises(ValueError, match="hour field"):
        TimerSpec(due=T0, cron="0 25 * * *")
    with pytest.raises(ValueError, match="unknown time zone"):
        TimerSpec(due=T0, cron="0 1 * * *", tz="Nowhere/Special")
    with pytest.raises(TypeError, match="whole epoch seconds"):
        TimerSpec(due=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="whole epoch seconds"):
        plan(TimerSpec(due=T0), float(T0))  # type: ignore[arg-type]


# --- event keys ---


def test_event_key_format() -> None:
    assert event_key("tmr_42", 1_767_225_600) == "tmr_42@1767225600"
    assert event_key(7, 0) == "7@0"
    with pytest.raises(TypeError):
        event_key("tmr_42", 1_767_225_600.0)  # type: ignore[arg-type]


def test_event_keys_of_a_catch_up_are_distinct() -> None:
    result = plan(TimerSpec(due=T0, every=DAY, catch_up="each"), OUTAGE_NOW)
    keys = [event_key("t1", o.scheduled_for) for o in result.fire]
    assert len(set(keys)) == 4
