"""The scheduler loop in-process, on a controllable clock, against the real broker and ledger.

Each test drives :meth:`Scheduler.run_pass` at instants it chooses and reads back what the
broker acknowledged (every message on the test's topic) and what the ledger holds.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from scheduler_support import DAY, bodies, read_topic, record, topic_size, utc
from support import query, scalar, wait_for
from vigil.bus.kafka import EventProducer, ProduceError
from vigil.clock import ManualClock
from vigil.ledger import approvals
from vigil.ledger.db import connect
from vigil.ledger.queries import Q
from vigil.ledger.states import ApprovalAnswer, CatchUp, TimerKind
from vigil.scheduler.loop import Scheduler
from vigil.scheduler.settings import SchedulerSettings
from vigil.scheduler.timers import NewTimer, parse_timer, upsert

T0 = utc(2026, 1, 5, 9, 0)
USER = "u-1"


def make_settings(stack, ledger, topics, **overrides) -> SchedulerSettings:
    return SchedulerSettings(
        **{"kafka_bootstrap": stack.bootstrap, "database_url": ledger, "events_topic": topics.events, **overrides}
    )


@pytest.fixture
def sched(stack, ledger, topics):
    settings = make_settings(stack, ledger, topics)
    producer = EventProducer(settings)
    scheduler = Scheduler(settings, producer, ManualClock(T0))
    yield scheduler
    scheduler.close()
    producer.close()


def add(dsn: str, body: dict, now: int = T0, user: str = USER):
    with connect(dsn, autocommit=True) as conn:
        return upsert(conn, parse_timer(user, body, now))


def timer(dsn: str, timer_id: str, user: str = USER) -> dict:
    return query(dsn, "SELECT * FROM timers WHERE user_id = %s AND id = %s", (user, timer_id))[0]


def at(scheduler: Scheduler, instant: int):
    scheduler.clock.set(instant)
    return scheduler.run_pass()


def test_second_pass_at_the_same_instant_fires_nothing(sched, ledger, stack, topics):
    add(ledger, {"id": "once", "due": T0})
    add(ledger, {"id": "hourly", "due": T0, "every": 3600})
    add(ledger, {"id": "daily", "due": T0, "cron": "0 9 * * *", "catch_up": "each"})

    first = at(sched, T0 + 5)
    second = at(sched, T0 + 5)

    assert (first.timers, first.events) == (3, 3)
    assert (second.timers, second.events) == (0, 0)
    assert topic_size(stack.bootstrap, topics.events) == 3
    assert timer(ledger, "once")["done"] and timer(ledger, "once")["fired_count"] == 1
    assert int(timer(ledger, "hourly")["due"].timestamp()) == T0 + 3600
    assert int(timer(ledger, "daily")["due"].timestamp()) == T0 + DAY


def test_reregistering_with_the_old_due_leaves_one_event_per_occurrence(sched, ledger, stack, topics):
    digest = {"id": "digest", "due": T0, "every": DAY, "payload": {"task": "daily digest"}}
    add(ledger, digest)
    add(ledger, {"id": "remind", "due": T0})
    assert at(sched, T0).events == 2

    # A deploy runs its set-up again with the schedule's first due time.
    assert add(ledger, digest).status == "updated"
    assert add(ledger, {"id": "remind", "due": T0}).status == "unchanged"
    assert int(timer(ledger, "digest")["due"].timestamp()) == T0 + DAY  # the later stored due stands
    assert timer(ledger, "remind")["done"]
    assert at(sched, T0).events == 0

    # Should a row be put back anyway (a crash before commit does exactly this), the
    # occurrence is produced again under the same key and the ledger keeps one.
    query(ledger, "UPDATE timers SET due = to_timestamp(%s), handled_through = NULL WHERE id = 'digest'", (T0,))
    assert at(sched, T0).events == 1
    produced = read_topic(stack.bootstrap, topics.events)
    record(ledger, produced)
    keys = [e.source_id for e in produced if e.source_id.startswith("digest@")]
    assert keys == [f"digest@{T0}", f"digest@{T0}"]
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source_id = %s", (f"digest@{T0}",)) == 1


def test_revived_schedule_does_not_refire_what_it_fired_before_cancel(sched, ledger, stack, topics):
    # `each` would fire every occurrence from the due on, so it shows whether T0 comes back.
    digest = {"id": "digest", "due": T0, "every": DAY, "catch_up": "each"}
    add(ledger, digest)
    at(sched, T0)
    query(ledger, Q.timer_cancel, {"user_id": USER, "id": "digest"})
    assert at(sched, T0 + DAY).events == 0  # cancelled: nothing

    assert add(ledger, digest, now=T0 + DAY + 60).status == "updated"
    at(sched, T0 + DAY + 60)

    keys = [e.source_id for e in read_topic(stack.bootstrap, topics.events)]
    assert keys == [f"digest@{T0}", f"digest@{T0 + DAY}"]


def test_outage_of_three_occurrences_and_ten_minutes(sched, ledger, stack, topics):
    for policy in CatchUp:
        add(ledger, {"id": f"digest-{policy}", "due": T0, "every": DAY, "catch_up": policy.value})
    at(sched, T0)
    produced_before = topic_size(stack.bootstrap, topics.events)
    later = T0 + DAY + 3 * DAY + 600  # the next due, then three more days and ten minutes

    report = at(sched, later)

    after = read_topic(stack.bootstrap, topics.events)[produced_before:]
    by_timer: dict[str, list] = {}
    for event in after:
        by_timer.setdefault(json.loads(event.payload)["timer_id"], []).append(event)

    (coalesced,) = by_timer["digest-coalesce"]
    body = json.loads(coalesced.payload)
    assert body == {
        "timer_id": "digest-coalesce",
        "scheduled_for": T0 + 4 * DAY,
        "late_by": 600,
        "skipped": 3,
        "payload": {},
    }
    assert coalesced.kind == "timer.schedule" and coalesced.source == "timer"
    next_due = timer(ledger, "digest-coalesce")["due"].timestamp()
    assert round((next_due - later) / 3600, 1) == 23.8

    each = by_timer["digest-each"]
    assert [e.source_id for e in each] == [f"digest-each@{T0 + k * DAY}" for k in (1, 2, 3, 4)]
    assert [b["late_by"] for b in bodies(each)] == [3 * DAY + 600, 2 * DAY + 600, DAY + 600, 600]

    assert "digest-skip" not in by_timer
    assert timer(ledger, "digest-skip")["due"].timestamp() == T0 + 5 * DAY > later
    assert report.summary() == (
        "coalesce: 1 timer(s) -> 1 event(s), 3 occurrence(s) skipped; "
        "each: 1 timer(s) -> 4 event(s), 0 occurrence(s) skipped; "
        "skip: 1 timer(s) -> 0 event(s), 4 occurrence(s) skipped"
    )


def test_each_is_capped_and_a_missed_skip_one_off_is_marked(stack, ledger, topics):
    settings = make_settings(stack, ledger, topics, scheduler_each_cap=3)
    producer = EventProducer(settings)
    scheduler = Scheduler(settings, producer, ManualClock(T0 + 10 * 3600))
    try:
        add(ledger, {"id": "recon", "due": T0, "every": 3600, "catch_up": "each"})
        add(ledger, {"id": "ping", "due": T0, "catch_up": "skip"})
        report = scheduler.run_pass()
    finally:
        scheduler.close()
        producer.close()
    keys = [e.source_id for e in read_topic(stack.bootstrap, topics.events)]
    assert keys == [f"recon@{T0 + h * 3600}" for h in (8, 9, 10)]  # the latest three of eleven
    assert report.by_policy[("each", "skipped")] == 8
    ping = timer(ledger, "ping")
    assert ping["done"] and ping["skipped"] and ping["fired_count"] == 0


# Expected instants are worked out by hand from the US rules (as in test_timing.py), not
# from zoneinfo. "day" is the local calendar day of the change, as UTC [start, end).
@pytest.mark.parametrize(
    ("start", "day", "expected"),
    [
        # Spring forward, 2026-03-08: 02:00 EST jumps to 03:00 EDT (07:00 UTC).
        (
            utc(2026, 3, 7, 12),
            (utc(2026, 3, 8, 5), utc(2026, 3, 9, 4)),
            {
                "gap": [utc(2026, 3, 8, 7, 0), utc(2026, 3, 9, 6, 30)],  # 02:30 does not exist: 03:00 EDT
                "fold": [utc(2026, 3, 8, 6, 30), utc(2026, 3, 9, 5, 30)],
                "hours_that_day": 23,
            },
        ),
        # Fall back, 2026-11-01: 02:00 EDT returns to 01:00 EST (06:00 UTC).
        (
            utc(2026, 10, 31, 12),
            (utc(2026, 11, 1, 4), utc(2026, 11, 2, 5)),
            {
                "gap": [utc(2026, 11, 1, 7, 30), utc(2026, 11, 2, 7, 30)],
                "fold": [utc(2026, 11, 1, 5, 30), utc(2026, 11, 2, 6, 30)],  # 01:30 twice: the first only
                "hours_that_day": 25,
            },
        ),
    ],
    ids=["spring-forward", "fall-back"],
)
def test_cron_in_new_york_fires_at_the_right_instants_once_across_dst(
    sched, ledger, stack, topics, start, day, expected
):
    tz = {"tz": "America/New_York"}
    add(ledger, {"id": "gap", "cron": "30 2 * * *", **tz}, now=start)
    add(ledger, {"id": "fold", "cron": "30 1 * * *", **tz}, now=start)
    add(ledger, {"id": "hourly", "cron": "0 * * * *", **tz}, now=start)
    end = start + 2 * DAY
    for instant in range(start, end + 1, 900):  # the loop ticks every 15 minutes of fake time
        at(sched, instant)

    fired: dict[str, list[int]] = {}
    for body in bodies(read_topic(stack.bootstrap, topics.events)):
        assert body["late_by"] == 0 and body["skipped"] == 0
        fired.setdefault(body["timer_id"], []).append(body["scheduled_for"])
    assert fired["gap"] == expected["gap"]
    assert fired["fold"] == expected["fold"]
    hourly = fired["hourly"]
    assert hourly == list(range(start + 3600, end + 1, 3600))  # every UTC hour, none twice
    assert len([t for t in hourly if day[0] <= t < day[1]]) == expected["hours_that_day"]


def _approval(dsn: str, request_id: str, due: int, on_expiry: str, deadline: float | None = None) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(
            Q.approval_create,
            {
                "request_id": request_id,
                "user_id": USER,
                "session_id": f"s-{request_id}",
                "run_id": None,
                "tool": "refund",
                "tool_use_id": "toolu_1",
                "args_hash": "h",
                "on_expiry": on_expiry,
                "due": datetime.fromtimestamp(due if deadline is None else deadline, UTC),
            },
        )
        # What the worker's finish writes next to the request: the expiry, keyed by the request.
        upsert(
            conn,
            NewTimer(
                USER,
                f"approval:{request_id}",
                TimerKind.APPROVAL_EXPIRY,
                due,
                payload={"request_id": request_id},
                fixed_key=request_id,
            ),
        )


def test_approval_expiry_denies_escalates_and_wakes_the_session(sched, ledger, stack, topics):
    due = T0 + 4 * 3600
    _approval(ledger, "refund-881", due, "deny")
    _approval(ledger, "refund-882", due, "escalate")
    _approval(ledger, "refund-883", due, "deny")
    with connect(ledger) as conn:  # 883 was answered in time
        approvals.answer(conn, "refund-883", ApprovalAnswer.YES, datetime.fromtimestamp(T0 + 3600, UTC))

    at(sched, due + 5)
    escalated_due = due + sched.settings.scheduler_escalate_after_s
    assert int(timer(ledger, "approval:refund-882")["due"].timestamp()) == escalated_due
    assert not timer(ledger, "approval:refund-882")["done"]
    assert at(sched, escalated_due - 1).events == 0
    # Fail closed: asked again at every deadline, never expired on silence.
    step = sched.settings.scheduler_escalate_after_s
    at(sched, escalated_due)
    at(sched, escalated_due + step)
    assert int(timer(ledger, "approval:refund-882")["due"].timestamp()) == escalated_due + 2 * step
    assert scalar(ledger, "SELECT answer FROM approvals WHERE request_id = 'refund-882'") is None
    # ... until an operator denies it: the expiry timer fires at once with the denial.
    deny_at = escalated_due + step + 60
    with connect(ledger) as conn:
        assert approvals.operator_deny(conn, "refund-882", datetime.fromtimestamp(deny_at, UTC))[0]
        assert not approvals.operator_deny(conn, "refund-882", datetime.fromtimestamp(deny_at, UTC))[0]
    at(sched, deny_at)

    woke = {(e.source_id, e.kind): json.loads(e.payload)["answer"] for e in read_topic(stack.bootstrap, topics.events)}
    assert woke == {
        ("refund-881", "approval.answer"): "expired",
        ("refund-882/escalation", "approval.escalate"): "pending",
        ("refund-882/escalation/2", "approval.escalate"): "pending",
        ("refund-882/escalation/3", "approval.escalate"): "pending",
        ("refund-882", "approval.answer"): "no",
        ("refund-883", "approval.answer"): "yes",  # the expiry still delivers the standing answer
    }
    answers = {r["request_id"]: r["answer"] for r in query(ledger, "SELECT request_id, answer FROM approvals")}
    assert answers == {"refund-881": "expired", "refund-882": "no", "refund-883": "yes"}
    assert scalar(ledger, "SELECT count(*) FROM timers WHERE NOT done") == 0


def test_an_expiry_timer_earlier_than_its_approvals_deadline_waits_for_it(sched, ledger, stack, topics):
    # The finish stores the timer in whole seconds (truncated) and the deadline as given.
    _approval(ledger, "refund-7", T0, "deny", deadline=T0 + 0.4)
    assert at(sched, T0).events == 0
    assert int(timer(ledger, "approval:refund-7")["due"].timestamp()) == T0 + 1
    assert scalar(ledger, "SELECT answer FROM approvals") is None  # never expired before its deadline
    assert at(sched, T0 + 1).events == 1
    assert scalar(ledger, "SELECT answer FROM approvals") == "expired"


def test_unacknowledged_produce_advances_nothing(stack, ledger, topics):
    # A broker address where nothing listens: the produce can never be acknowledged.
    from vigil_dev.devstack import free_port

    settings = make_settings(stack, ledger, topics, produce_timeout_s=1.0)
    dead = make_settings(stack, ledger, topics, kafka_bootstrap=f"127.0.0.1:{free_port()}", produce_timeout_s=1.0)
    add(ledger, {"id": "digest", "due": T0, "every": DAY})
    _approval(ledger, "refund-9", T0, "deny")
    producer = EventProducer(dead)
    scheduler = Scheduler(settings, producer, ManualClock(T0 + 1))
    try:
        with pytest.raises(ProduceError):
            scheduler.run_pass()
    finally:
        scheduler.close()
        producer.close(timeout=0.1)
    assert int(timer(ledger, "digest")["due"].timestamp()) == T0 and timer(ledger, "digest")["fired_count"] == 0
    assert scalar(ledger, "SELECT answer FROM approvals") is None  # the expiry rolled back with the pass


def test_a_row_that_cannot_be_planned_is_set_aside_not_retried_forever(sched, ledger, stack, topics):
    add(ledger, {"id": "good", "due": T0})
    query(
        ledger,
        "INSERT INTO timers (id, user_id, kind, due, cron, tz) VALUES ('bad', %s, 'schedule', to_timestamp(%s), "
        "'0 9 * * *', 'Mars/Olympus_Mons')",
        (USER, T0 - 60),
    )
    report = at(sched, T0)
    assert report.events == 1 and report.by_policy[("*", "set_aside")] == 1
    bad = timer(ledger, "bad")
    assert bad["done"] and "Mars/Olympus_Mons" in bad["error"]
    assert at(sched, T0 + 60).timers == 0


def test_due_backlog_counts_due_live_timers(sched, ledger):
    add(ledger, {"id": "a", "due": T0 - 120})
    add(ledger, {"id": "b", "due": T0 + 60})
    assert sched.backlog() == (1, T0 - 120)
    at(sched, T0)
    assert sched.backlog() == (0, None)


def test_the_loop_survives_its_ledger_connection_being_killed(stack, ledger, topics):
    import threading

    from prometheus_client import REGISTRY

    def ledger_failures() -> float:
        return REGISTRY.get_sample_value("vigil_scheduler_pass_failures_total", {"reason": "ledger"}) or 0.0

    settings = make_settings(stack, ledger, topics, scheduler_tick_s=0.05, scheduler_grace_s=60)
    producer = EventProducer(settings)
    scheduler = Scheduler(settings, producer, ManualClock(T0))
    stopping = threading.Event()
    health: list[bool] = []
    loop = threading.Thread(target=scheduler.run, args=(stopping, health.append), daemon=True)
    failures = ledger_failures()
    try:
        loop.start()
        wait_for(lambda: health, 10, "a first pass")
        # What a database failover or an idle-connection reaper does to the scheduler. Client
        # backends only: an autovacuum worker in this database is a superuser's process.
        query(
            ledger,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        )
        add(ledger, {"id": "after", "due": T0})
        wait_for(lambda: timer(ledger, "after")["done"], 10, "the timer to fire on a new connection")
    finally:
        stopping.set()
        loop.join(10)
        scheduler.close()
        producer.close()
    assert not loop.is_alive()
    assert ledger_failures() == failures + 1
    assert False in health and health[-1] is True
    assert [e.source_id for e in read_topic(stack.bootstrap, topics.events)] == [f"after@{T0}"]
