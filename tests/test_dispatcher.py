"""The dispatcher in this process, against the real ledger and a real HTTP receiver, on a
clock the test moves: pacing (the source scenario, urgent messages, the daily cap), retries
with backoff and Retry-After, dead deliveries, and the send lease."""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest
from psycopg.rows import dict_row

from dispatcher_support import (
    T0,
    Receiver,
    add_message,
    add_webhook_users,
    in_process_dispatcher,
    one_pass,
    sample,
    standard_webhooks_valid,
)
from support import query, scalar, wait_for
from vigil.clock import ManualClock, utc
from vigil.dispatcher.channels import Outcome, Result
from vigil.dispatcher.claims import claim
from vigil.dispatcher.operator import dead_deliveries
from vigil.ledger import outbox

MINUTE = 60


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def dispatch(ledger):
    made = []

    def make(clock, **overrides):
        d = in_process_dispatcher(ledger, clock, **overrides)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def at(clock: ManualClock, minutes: float):
    clock.set((T0 + timedelta(minutes=minutes)).timestamp())
    return utc(clock.now())


def test_source_scenario_three_updates_in_an_hour_make_two_deliveries(ledger, receiver, dispatch):
    """Seed 000 section 8: a 1 h gap, updates at minutes 0, 10 and 20: `update 0` at once,
    `update 1` + `update 2` joined at minute 61."""
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, outbox_gap=3600)
    secret = add_webhook_users(ledger, ["ana"], receiver.url)["ana"]
    for n, minute in enumerate((0, 10, 20)):
        add_message(ledger, "ana", f"update {n}", created_at=at(clock, minute))
        one_pass(d)
    at(clock, 59.99)
    one_pass(d)
    assert [r.bodies for r in receiver.got()] == [["update 0"]], "only update 0 inside the first hour"

    at(clock, 61)
    one_pass(d)
    got = receiver.got()
    assert [r.bodies for r in got] == [["update 0"], ["update 1", "update 2"]]
    assert got[1].data["text"] == "update 1\n\nupdate 2"
    assert [r.timestamp for r in got] == [int(T0.timestamp()), int((T0 + timedelta(minutes=61)).timestamp())]
    assert all(standard_webhooks_valid(secret, r) for r in got)
    assert got[0].id != got[1].id
    rows = query(ledger, "SELECT body, status, delivery_id::text AS d, attempts FROM outbox ORDER BY id")
    assert [(r["status"], r["d"], r["attempts"]) for r in rows] == [
        ("delivered", got[0].id, 1),
        ("delivered", got[1].id, 1),
        ("delivered", got[1].id, 1),
    ]
    assert scalar(ledger, "SELECT last_delivery_at FROM users") == T0 + timedelta(minutes=61)


def test_urgent_inside_the_gap_goes_at_once_with_what_was_held_and_restarts_the_gap(ledger, receiver, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, outbox_gap=3600)
    add_webhook_users(ledger, ["ana"], receiver.url)
    bypasses = sample("vigil_urgent_bypasses_total")
    add_message(ledger, "ana", "morning summary", created_at=at(clock, 0))
    one_pass(d)
    add_message(ledger, "ana", "held note", created_at=at(clock, 2))
    one_pass(d)
    add_message(ledger, "ana", "the build is red", urgent=True, created_at=at(clock, 5))
    one_pass(d)
    got = receiver.got()
    assert [r.bodies for r in got] == [["morning summary"], ["held note", "the build is red"]]
    assert got[1].data["urgent"] is True
    assert sample("vigil_urgent_bypasses_total") == bypasses + 1

    # The urgent delivery at minute 5 restarted the gap: the next waits until minute 65.
    add_message(ledger, "ana", "fyi", created_at=at(clock, 6))
    at(clock, 64)
    one_pass(d)
    assert len(receiver.got()) == 2
    at(clock, 65)
    one_pass(d)
    assert [r.bodies for r in receiver.got()][2] == ["fyi"]


def test_urgent_daily_cap_makes_urgent_messages_wait_like_others_until_the_next_day(ledger, receiver, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, outbox_gap=3600, urgent_daily_cap=5)
    add_webhook_users(ledger, ["ana"], receiver.url)
    with psycopg.connect(ledger) as conn:  # the operator's per-user cap wins over the default
        conn.execute("UPDATE channels SET urgent_daily_cap = 1 WHERE user_id = 'ana'")
    add_message(ledger, "ana", "hello", created_at=at(clock, 0))
    one_pass(d)
    add_message(ledger, "ana", "urgent one", urgent=True, created_at=at(clock, 5))
    one_pass(d)
    add_message(ledger, "ana", "urgent two", urgent=True, created_at=at(clock, 10))
    one_pass(d)
    at(clock, 64)
    one_pass(d)
    assert [r.bodies for r in receiver.got()] == [["hello"], ["urgent one"]], "the cap of 1 is used up"
    at(clock, 65)
    one_pass(d)
    assert [r.bodies for r in receiver.got()][2] == ["urgent two"]
    assert query(ledger, "SELECT urgent_day, urgent_count FROM users")[0] == {
        "urgent_day": T0.date(),
        "urgent_count": 1,
    }

    # A new UTC day: the cap starts over.
    next_day = T0 + timedelta(days=1)
    clock.set(next_day.timestamp())
    one_pass(d)
    add_message(ledger, "ana", "plain", created_at=utc(clock.now()))
    one_pass(d)
    add_message(ledger, "ana", "urgent three", urgent=True, created_at=at(clock, 24 * 60 + 1))
    one_pass(d)
    assert [r.bodies for r in receiver.got()][-2:] == [["plain"], ["urgent three"]]


def test_an_approval_question_past_the_urgent_cap_is_not_held_beyond_its_deadline(ledger, receiver, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, outbox_gap=3600, urgent_daily_cap=0)  # no urgent bypass at all today
    add_webhook_users(ledger, ["ana"], receiver.url)
    add_message(ledger, "ana", "hello", created_at=at(clock, 0))
    one_pass(d)
    add_message(ledger, "ana", "urgent news", urgent=True, created_at=at(clock, 5))
    one_pass(d)
    assert len(receiver.got()) == 1, "an ordinary urgent message waits for the gap"
    # The question's deadline (as the worker's finish stores it) is inside the gap.
    question = add_message(ledger, "ana", "Approval needed: refund", urgent=True, created_at=at(clock, 10))
    with psycopg.connect(ledger) as conn:
        conn.execute("UPDATE outbox SET deadline = %s WHERE id = %s", (T0 + timedelta(minutes=40), question))
    one_pass(d)
    assert [r.bodies for r in receiver.got()][1] == ["urgent news", "Approval needed: refund"]
    assert scalar(ledger, "SELECT urgent_count FROM users") == 1  # it still counts against the cap


def test_503_then_200_is_delivered_after_recovery_with_retries_counted_and_retry_after_honoured(
    ledger, receiver, dispatch
):
    failures = {"left": 3}

    def answer(_request):
        if failures["left"] > 0:
            failures["left"] -= 1
            return 503, {"retry-after": "120"}
        return 200, {}

    receiver.answer = answer
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, delivery_backoff_base_s=30, delivery_backoff_cap_s=600)
    secret = add_webhook_users(ledger, ["ana"], receiver.url)["ana"]
    add_message(ledger, "ana", "status report", created_at=T0)
    retries = sample("vigil_delivery_retries_total", {"channel": "webhook", "reason": "failed"})
    delivered = sample("vigil_deliveries_total", {"channel": "webhook", "result": "delivered"})

    one_pass(d)
    row = query(ledger, "SELECT status, attempts, next_attempt_at, error FROM outbox")[0]
    assert (row["status"], row["attempts"], row["error"]) == ("pending", 1, "HTTP 503")
    # Retry-After (120 s) beats the 30 s backoff.
    assert row["next_attempt_at"] >= T0 + timedelta(seconds=120)
    clock.set((T0 + timedelta(seconds=119)).timestamp())
    one_pass(d)
    assert len(receiver.got()) == 1, "no attempt before Retry-After has passed"

    for _ in range(3):
        clock.advance(700)  # past any backoff up to the cap
        one_pass(d)
    got = receiver.got()
    assert len(got) == 4
    assert len({r.id for r in got}) == 1 and len({r.body for r in got}) == 1, "every attempt is the same delivery"
    assert all(standard_webhooks_valid(secret, r) for r in got)
    row = query(ledger, "SELECT status, attempts, error, delivered_at FROM outbox")[0]
    assert (row["status"], row["attempts"], row["error"]) == ("delivered", 4, None)
    assert sample("vigil_delivery_retries_total", {"channel": "webhook", "reason": "failed"}) == retries + 3
    assert sample("vigil_deliveries_total", {"channel": "webhook", "result": "delivered"}) == delivered + 1


def test_410_is_dead_at_once_kept_and_listed(ledger, receiver, dispatch):
    receiver.answer = lambda r: (410, {}) if r.path.endswith("/gone") else (200, {})
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock)
    add_webhook_users(ledger, ["gone"], receiver.url.replace("/hook", "/gone"))
    add_webhook_users(ledger, ["fine"], receiver.url)
    dead = sample("vigil_dead_deliveries_total", {"channel": "webhook", "reason": "rejected"})
    add_message(ledger, "gone", "are you there?", created_at=T0)
    add_message(ledger, "fine", "hello", created_at=T0)
    one_pass(d)
    clock.advance(86_400)
    one_pass(d)
    assert sorted(r.path for r in receiver.got()) == ["/gone", "/hook"], "a 410 is never retried"
    row = query(
        ledger, "SELECT status, attempts, error, dead_at, delivery_id::text AS d FROM outbox WHERE user_id = 'gone'"
    )[0]
    assert (row["status"], row["attempts"], row["error"]) == ("dead", 1, "HTTP 410 (not retried)")
    assert row["dead_at"] == T0
    assert sample("vigil_dead_deliveries_total", {"channel": "webhook", "reason": "rejected"}) == dead + 1
    with psycopg.connect(ledger, row_factory=psycopg.rows.dict_row) as conn:
        listed = dead_deliveries(conn, 10)
    assert [(str(x["delivery_id"]), x["user_id"], x["messages"]) for x in listed] == [(row["d"], "gone", 1)]


def test_failures_up_to_max_attempts_end_dead_and_timeouts_are_retried(ledger, receiver, dispatch):
    import time

    def answer(request):
        if request.path.endswith("/slow"):
            time.sleep(0.6)
        return 500, {}

    receiver.answer = answer
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, delivery_max_attempts=3, delivery_http_timeout_s=0.3, delivery_backoff_cap_s=60)
    add_webhook_users(ledger, ["ana"], receiver.url)
    add_webhook_users(ledger, ["slow"], receiver.url.replace("/hook", "/slow"))
    add_message(ledger, "ana", "one", created_at=T0)
    add_message(ledger, "slow", "two", created_at=T0)
    exhausted = sample("vigil_dead_deliveries_total", {"channel": "webhook", "reason": "exhausted"})
    one_pass(d)
    assert query(ledger, "SELECT error FROM outbox WHERE user_id = 'slow'")[0]["error"] == "no answer within 0.3s"
    for _ in range(4):
        clock.advance(120)
        one_pass(d)
    rows = query(ledger, "SELECT user_id, status, attempts, error FROM outbox ORDER BY user_id")
    assert [(r["user_id"], r["status"], r["attempts"]) for r in rows] == [("ana", "dead", 3), ("slow", "dead", 3)]
    assert rows[0]["error"] == "HTTP 500; dead after 3 attempts"
    assert sample("vigil_dead_deliveries_total", {"channel": "webhook", "reason": "exhausted"}) == exhausted + 2
    assert len([r for r in receiver.got() if r.path == "/hook"]) == 3


def test_a_send_whose_dispatcher_vanished_goes_again_under_its_id_after_the_lease(ledger, receiver, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, delivery_lease_s=300, delivery_max_attempts=3)
    add_webhook_users(ledger, ["ana"], receiver.url)
    add_message(ledger, "ana", "one", created_at=T0)
    lost = sample("vigil_delivery_retries_total", {"channel": "webhook", "reason": "lost"})
    # A dispatcher claims and dies before sending anything (its claim is committed).
    first = claim(d.conn, utc(clock.now()), d.limits).deliveries[0]
    clock.advance(299)
    assert one_pass(d) == 0, "the lease still stands"
    clock.advance(2)
    assert one_pass(d) == 1
    got = receiver.got()
    assert [r.id for r in got] == [str(first.delivery_id)]
    assert sample("vigil_delivery_retries_total", {"channel": "webhook", "reason": "lost"}) == lost + 1
    # The vanished dispatcher comes back and reports its attempt 1: too late, it is superseded.
    superseded = sample("vigil_delivery_superseded_total", {"channel": "webhook"})
    d.recorder.record(first, Outcome(Result.DELIVERED))
    assert sample("vigil_delivery_superseded_total", {"channel": "webhook"}) == superseded + 1
    assert query(ledger, "SELECT status, attempts FROM outbox")[0] == {"status": "delivered", "attempts": 2}


def test_outcomes_that_arrive_together_are_recorded_together_each_fenced_by_its_attempt(ledger, dispatch):
    """Accepted sends are recorded in one statement, but each only if its attempt still holds
    its delivery: one whose lease was taken over in the meantime is dropped (superseded), the
    others are delivered; a failed attempt beside them is recorded on its own."""
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, delivery_lease_s=300, delivery_max_attempts=3)
    add_webhook_users(ledger, ["ana", "bo", "cy", "di"], "http://127.0.0.1:9/unused")
    for user in ("ana", "bo", "cy", "di"):
        add_message(ledger, user, f"to {user}", created_at=T0)
    deliveries = {x.user_id: x for x in claim(d.conn, utc(clock.now()), d.limits).deliveries}
    # bo's attempt 1 was taken over: its lease passed and another dispatcher sent attempt 2.
    query(ledger, "UPDATE outbox SET attempts = 2 WHERE user_id = 'bo'")
    superseded = sample("vigil_delivery_superseded_total", {"channel": "webhook"})
    delivered = sample("vigil_deliveries_total", {"channel": "webhook", "result": "delivered"})
    d.recorder.keep(deliveries["ana"], Outcome(Result.DELIVERED))
    d.recorder.keep(deliveries["bo"], Outcome(Result.DELIVERED))
    d.recorder.keep(deliveries["cy"], Outcome(Result.DELIVERED))
    d.recorder.keep(deliveries["di"], Outcome(Result.RETRY, "503"))
    d.recorder.settle()
    assert d.recorder.unrecorded == 0
    rows = {
        r["user_id"]: (r["status"], r["attempts"])
        for r in query(ledger, "SELECT user_id, status, attempts FROM outbox")
    }
    assert rows == {"ana": ("delivered", 1), "bo": ("sending", 2), "cy": ("delivered", 1), "di": ("pending", 1)}
    assert sample("vigil_delivery_superseded_total", {"channel": "webhook"}) == superseded + 1
    assert sample("vigil_deliveries_total", {"channel": "webhook", "result": "delivered"}) == delivered + 2


def test_a_pass_whose_due_users_another_replica_is_claiming_takes_the_next_ones(ledger, receiver, dispatch):
    """Another replica's claim holds its users' locks (for milliseconds): this pass skips them
    and takes the next due users at once, rather than finding nothing and waiting out its poll
    interval; the sweep then wraps to the first user."""
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, dispatcher_batch_users=2)
    users = ["ana", "bo", "cy", "di"]
    add_webhook_users(ledger, users, receiver.url)
    for user in users:
        add_message(ledger, user, f"to {user}", created_at=T0)
    with psycopg.connect(ledger, row_factory=dict_row) as other:
        held = outbox.lock_due_users(other, now=utc(clock.now()), default_gap_s=3600, limit=2)
        assert [u.user_id for u in held.users] == ["ana", "bo"]
        assert one_pass(d) == 2
        assert sorted(r.user for r in receiver.got()) == ["cy", "di"]
        other.rollback()
    assert one_pass(d) == 2
    assert sorted(r.user for r in receiver.got()) == users


def test_a_delivery_whose_dispatchers_keep_dying_is_buried_after_max_attempts(ledger, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, delivery_lease_s=300, delivery_max_attempts=2)
    add_webhook_users(ledger, ["ana"], "http://127.0.0.1:9/never")
    add_message(ledger, "ana", "one", created_at=T0)
    for _ in range(2):
        assert len(claim(d.conn, utc(clock.now()), d.limits).deliveries) == 1
        clock.advance(301)
    buried = claim(d.conn, utc(clock.now()), d.limits).buried
    assert len(buried) == 1
    row = query(ledger, "SELECT status, attempts, error FROM outbox")[0]
    assert (row["status"], row["attempts"]) == ("dead", 2)
    assert row["error"].startswith("no outcome recorded after 2 attempts")


def test_a_user_locked_by_another_claim_is_skipped_not_waited_for(ledger, receiver, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock)
    add_webhook_users(ledger, ["ana", "bob"], receiver.url)
    add_message(ledger, "ana", "for ana", created_at=T0)
    add_message(ledger, "bob", "for bob", created_at=T0)
    with psycopg.connect(ledger) as other:  # another dispatcher mid-claim on ana
        other.execute("SELECT 1 FROM users WHERE user_id = 'ana' FOR UPDATE")
        assert one_pass(d) == 1
        assert [r.user for r in receiver.got()] == ["bob"]
    assert one_pass(d) == 1
    assert sorted(r.user for r in receiver.got()) == ["ana", "bob"]


def test_a_send_whose_ledger_went_away_does_not_wait_out_its_lease(ledger, dispatch):
    """The ledger drops the dispatcher's connection while a send is in flight: the outcome
    cannot be recorded then, and is recorded as soon as the ledger answers again, not after
    the lease (which held back every newer message of that user for its whole length)."""

    def drop_the_ledger(_request):
        # The receiver answers only once the dispatcher's session is gone (a failover, a restart).
        query(
            ledger,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        )
        return 200, {}

    receiver = Receiver(answer=drop_the_ledger).start()
    try:
        clock = ManualClock(T0.timestamp())
        d = dispatch(clock, delivery_lease_s=300)
        add_webhook_users(ledger, ["ana"], receiver.url)
        add_message(ledger, "ana", "one", created_at=T0)
        settled = sample("vigil_delivery_outcomes_settled_after_reconnect_total")
        with pytest.raises(psycopg.OperationalError):
            one_pass(d)
        assert query(ledger, "SELECT status FROM outbox")[0]["status"] == "sending"
        d.close_connection()  # what the loop does on a ledger error
        receiver.answer = lambda _r: (200, {})
        clock.advance(1)  # nowhere near the lease
        one_pass(d)
        row = query(ledger, "SELECT status, attempts FROM outbox")[0]
        assert row == {"status": "delivered", "attempts": 1}
        assert len(receiver.got()) == 1, "recorded, not sent again"
        assert sample("vigil_delivery_outcomes_settled_after_reconnect_total") == settled + 1
    finally:
        receiver.stop()


@pytest.fixture
def running(dispatch):
    """A dispatcher's own loop (`Dispatcher.run`) on a thread, stopped after the test."""
    started = []

    def start(clock, **overrides):
        d = dispatch(clock, **overrides)
        stopping = threading.Event()
        thread = threading.Thread(target=d.run, args=(stopping,), daemon=True)
        thread.start()
        started.append((stopping, thread))
        return d

    yield start
    for stopping, thread in started:
        stopping.set()
        thread.join(60)
        assert not thread.is_alive(), "the loop did not stop"


def test_a_slow_receiver_holds_its_own_send_not_the_deliveries_claimed_after_it(ledger, running):
    """The loop claims again while a send waits for its receiver: a receiver that takes its
    time (here until the test lets it answer) holds one send thread, and messages written
    meanwhile for other users go out at once instead of waiting for it."""
    release = threading.Event()

    def answer(request):
        if request.user == "slow":
            release.wait(30)
        return 200, {}

    receiver = Receiver(answer=answer).start()
    others = [f"u{i}" for i in range(6)]
    try:
        add_webhook_users(ledger, ["slow", *others], receiver.url)
        add_message(ledger, "slow", "for slow", created_at=T0)
        running(
            ManualClock(T0.timestamp()),
            dispatcher_poll_interval_s=0.05,
            dispatcher_batch_users=4,
            dispatcher_concurrency=2,
            delivery_http_timeout_s=40,
        )
        wait_for(lambda: receiver.got(), 10, "the slow receiver's request")
        for user in others:
            add_message(ledger, user, f"for {user}", created_at=T0)
        wait_for(
            lambda: scalar(ledger, "SELECT count(*) FROM outbox WHERE status = 'delivered'") == len(others),
            10,
            "the other users' deliveries while the slow one waits",
        )
        assert not release.is_set()
        assert scalar(ledger, "SELECT status FROM outbox WHERE user_id = 'slow'") == "sending"
    finally:
        release.set()
    try:
        wait_for(lambda: scalar(ledger, "SELECT status FROM outbox WHERE user_id = 'slow'") == "delivered", 10)
        assert sorted(r.user for r in receiver.got()) == sorted(["slow", *others]), "each sent once"
    finally:
        receiver.stop()


def test_the_loop_never_has_more_deliveries_out_than_one_claim_may_take(ledger, running):
    """However the claims overlap, at most VIGIL_DISPATCHER_BATCH_USERS deliveries are claimed
    and not finished at any moment: the bound the settings check the lease against (a send
    that starts later than that could outlive its lease and go out twice)."""
    lock = threading.Lock()
    state = {"most": 0}

    def answer(_request):
        sending = scalar(ledger, "SELECT count(*) FROM outbox WHERE status = 'sending'")
        with lock:
            state["most"] = max(state["most"], sending)
        threading.Event().wait(0.05)
        return 200, {}

    receiver = Receiver(answer=answer).start()
    users = [f"u{i:02d}" for i in range(40)]
    try:
        add_webhook_users(ledger, users, receiver.url)
        for user in users:
            add_message(ledger, user, f"for {user}", created_at=T0)
        running(ManualClock(T0.timestamp()), dispatcher_batch_users=6, dispatcher_concurrency=4)
        wait_for(
            lambda: scalar(ledger, "SELECT count(*) FROM outbox WHERE status = 'delivered'") == len(users),
            30,
            "every delivery",
        )
        assert sorted(r.user for r in receiver.got()) == users, "each sent once"
        assert 4 <= state["most"] <= 6, state
    finally:
        receiver.stop()


def test_between_sweeps_the_loop_looks_only_at_users_with_new_messages(ledger, running, monkeypatch):
    """A sweep reads every user that holds messages, most of them waiting out their gap; between
    sweeps (paced by what the last one cost) the loop claims only among users with messages
    written since it last looked. A message for a user whose gap has passed, or an urgent one,
    goes out within a poll interval; a held user whose gap passes meanwhile waits for the
    next sweep, or for its next message."""
    from vigil.dispatcher import chooser

    monkeypatch.setattr(chooser, "SWEEP_IDLE_FACTOR", 1e6)  # after the first sweep, none for the test's length
    receiver = Receiver().start()
    try:
        users = ["held", "held-urgent", "quiet"]
        add_webhook_users(ledger, users, receiver.url)
        query(ledger, "UPDATE users SET last_delivery_at = %s WHERE user_id <> 'quiet'", (T0 - timedelta(minutes=10),))
        query(ledger, "UPDATE users SET last_delivery_at = %s WHERE user_id = 'quiet'", (T0 - timedelta(hours=5),))
        add_message(ledger, "held", "held 1", created_at=T0)
        add_message(ledger, "held-urgent", "held 2", created_at=T0)
        clock = ManualClock(T0.timestamp())
        sweeps = sample("vigil_dispatcher_sweeps_total")
        running(clock, dispatcher_poll_interval_s=0.05, outbox_gap=3600)
        wait_for(lambda: sample("vigil_dispatcher_sweeps_total") == sweeps + 1, 10, "the first sweep")

        add_message(ledger, "quiet", "news", created_at=T0)
        add_message(ledger, "held-urgent", "now!", urgent=True, created_at=T0)
        wait_for(lambda: len(receiver.got()) == 2, 10, "the new messages' deliveries")
        assert {r.user: r.bodies for r in receiver.got()} == {"quiet": ["news"], "held-urgent": ["held 2", "now!"]}

        at(clock, 61)  # held's gap has passed, but nobody looks at it before the next sweep
        threading.Event().wait(1.0)
        assert len(receiver.got()) == 2
        add_message(ledger, "held", "held 3", created_at=T0)  # its next message brings it up
        wait_for(lambda: len(receiver.got()) == 3, 10, "held's delivery")
        assert receiver.got()[2].bodies == ["held 1", "held 3"]
        assert sample("vigil_dispatcher_sweeps_total") == sweeps + 1
    finally:
        receiver.stop()


def test_a_message_written_while_its_users_delivery_was_in_flight_follows_it_without_a_sweep(
    ledger, running, monkeypatch
):
    """Between sweeps a message written while its user's delivery is in flight is not due when
    the loop first sees it (one delivery in flight per user); once that delivery ends, the
    user is looked at again at once, not at the next sweep."""
    from vigil.dispatcher import chooser

    monkeypatch.setattr(chooser, "SWEEP_IDLE_FACTOR", 1e6)  # after the first sweep, none for the test's length
    release = threading.Event()

    def answer(request):
        if request.bodies == ["first"]:
            release.wait(30)
        return 200, {}

    receiver = Receiver(answer=answer).start()
    try:
        add_webhook_users(ledger, ["chatty"], receiver.url, gap=0)
        sweeps = sample("vigil_dispatcher_sweeps_total")
        running(ManualClock(T0.timestamp()), dispatcher_poll_interval_s=0.05, delivery_http_timeout_s=20)
        wait_for(lambda: sample("vigil_dispatcher_sweeps_total") == sweeps + 1, 10, "the first sweep")
        add_message(ledger, "chatty", "first", created_at=T0)
        wait_for(lambda: receiver.got(), 10, "the first delivery at the receiver")
        add_message(ledger, "chatty", "second", created_at=T0)
        threading.Event().wait(0.5)  # the loop sees it, behind the delivery in flight
        release.set()
        wait_for(lambda: len(receiver.got()) == 2, 10, "the second delivery")
        assert [r.bodies for r in receiver.got()] == [["first"], ["second"]]
        assert sample("vigil_dispatcher_sweeps_total") == sweeps + 1
    finally:
        release.set()
        receiver.stop()


def test_a_held_user_the_loop_has_seen_goes_out_when_its_gap_or_backoff_ends_without_a_sweep(
    ledger, running, monkeypatch
):
    """Between sweeps the loop remembers when a user it looked at and held may be due (its
    gap's end, a retry's backoff, a send's lease) and looks at it again then: a held message
    waits out its gap, and a retry its backoff, not the next sweep."""
    from vigil.dispatcher import chooser

    monkeypatch.setattr(chooser, "SWEEP_IDLE_FACTOR", 1e6)  # after the first sweep, none for the test's length
    failures = {"left": 1}

    def answer(request):
        if request.user == "flaky" and failures["left"]:
            failures["left"] -= 1
            return 503, {}
        return 200, {}

    receiver = Receiver(answer=answer).start()
    try:
        add_webhook_users(ledger, ["paced", "flaky"], receiver.url, gap=60)
        clock = ManualClock(T0.timestamp())
        sweeps = sample("vigil_dispatcher_sweeps_total")
        running(clock, dispatcher_poll_interval_s=0.05, delivery_backoff_base_s=20, delivery_backoff_cap_s=20)
        wait_for(lambda: sample("vigil_dispatcher_sweeps_total") == sweeps + 1, 10, "the first sweep")

        add_message(ledger, "paced", "one", created_at=T0)
        add_message(ledger, "flaky", "try", created_at=T0)
        retry = "SELECT count(*) FROM outbox WHERE user_id = 'flaky' AND status = 'pending' AND attempts = 1"
        wait_for(lambda: len(receiver.got()) == 2 and scalar(ledger, retry) == 1, 10, "one delivery, one retry")
        add_message(ledger, "paced", "two", created_at=T0)  # inside paced's 60 s gap: held
        wait_for(lambda: sample("vigil_dispatcher_wakeups") == 2, 10, "both users held with a moment to look again")
        assert len(receiver.got()) == 2

        clock.set(T0.timestamp() + 30)  # past flaky's backoff (20-22 s), inside paced's gap
        wait_for(lambda: len(receiver.got()) == 3, 10, "flaky's retry at the end of its backoff")
        threading.Event().wait(0.3)
        assert len(receiver.got()) == 3, "paced is still inside its gap"
        clock.set(T0.timestamp() + 61)
        wait_for(lambda: len(receiver.got()) == 4, 10, "paced's held message at the end of its gap")
        assert [(r.user, r.bodies) for r in receiver.got()[2:]] == [("flaky", ["try"]), ("paced", ["two"])]
        assert sample("vigil_dispatcher_sweeps_total") == sweeps + 1
    finally:
        receiver.stop()


def test_a_message_committed_after_a_later_one_is_not_left_for_the_next_sweep(ledger, running, monkeypatch):
    """Outbox ids are taken when a row is written, not when it commits: two finishes can commit
    out of id order. A claim between sweeps that saw the later one finds the earlier id with
    no row yet and looks at it again until it has one."""
    from vigil.dispatcher import chooser

    monkeypatch.setattr(chooser, "SWEEP_IDLE_FACTOR", 1e6)  # after the first sweep, none for the test's length
    receiver = Receiver().start()
    try:
        add_webhook_users(ledger, ["slow-finish", "fast-finish"], receiver.url)
        sweeps = sample("vigil_dispatcher_sweeps_total")
        running(ManualClock(T0.timestamp()), dispatcher_poll_interval_s=0.05)
        wait_for(lambda: sample("vigil_dispatcher_sweeps_total") == sweeps + 1, 10, "the first sweep")
        with psycopg.connect(ledger) as slow:
            slow.execute("INSERT INTO outbox (user_id, run_id, epoch, body) VALUES ('slow-finish', 0, 1, 'first')")
            add_message(ledger, "fast-finish", "second", created_at=T0)  # a higher id, committed first
            wait_for(lambda: len(receiver.got()) == 1, 10, "the second message's delivery")
            threading.Event().wait(0.3)  # claims go on meanwhile, the first id still without a row
        # the first transaction commits now
        wait_for(lambda: len(receiver.got()) == 2, 10, "the first message's delivery")
        assert [(r.user, r.bodies) for r in receiver.got()] == [("fast-finish", ["second"]), ("slow-finish", ["first"])]
        assert sample("vigil_dispatcher_sweeps_total") == sweeps + 1
    finally:
        receiver.stop()
