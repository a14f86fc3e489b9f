"""The dispatcher's claim under the statistics an outbox usually has.

While the dispatcher keeps up, nothing is pending when autovacuum analyzes the outbox: the
planner then believes every unfinished-row step returns one row. A burst of messages after
such an ANALYZE once made the due-users step rescan every unfinished row for each held one
(4.1 million rows, 0.3 s, for 2,050 unfinished rows). These tests read PostgreSQL's own
account of each statement the claim runs (auto_explain, custom and generic plans), as
tests/test_worker_claims.py does for the worker's claim and finish."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg.rows import dict_row

from support import auto_explain, explaining, query
from test_worker_claims import _max_rows_read_per_node, _nodes
from vigil.dispatcher.claims import Limits, claim, record_dead, record_delivered, record_retry
from vigil.ledger import outbox

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
USERS = 20_000  # every user the ledger knows, half of them with a channel
HISTORY = 100_000  # delivered rows: the outbox's history
HELD = 2_000  # the burst: one held message each for users u00000, u00010, ...
LOST = 50  # sends whose lease ran out: users u00001, u00011, ...
BURIED = 10  # sends whose lease ran out on their last attempt: users u00002, u00012, ..., u00092
GAP_S = 600


def user(i: int) -> str:
    return f"u{i:05d}"


def seed(ledger: str, analyze: str) -> None:
    """The history, ``analyze`` ('empty': before it, 'history': after it, nothing pending),
    then the burst with autovacuum kept away so the statistics stay as they were."""
    query(ledger, "ALTER TABLE outbox SET (autovacuum_enabled = false)")
    query(ledger, "ALTER TABLE users SET (autovacuum_enabled = false)")
    query(ledger, "ALTER TABLE channels SET (autovacuum_enabled = false)")
    query(
        ledger,
        """INSERT INTO users (user_id, home_topic, home_partition, last_delivery_at)
           SELECT 'u' || lpad(i::text, 5, '0'), 'events', 0, %s FROM generate_series(0, %s - 1) i""",
        (T0 - timedelta(hours=1), USERS),
    )
    query(
        ledger,
        """INSERT INTO channels (user_id, type) SELECT 'u' || lpad(i::text, 5, '0'), 'log'
           FROM generate_series(0, %s - 1, 2) i""",
        (USERS,),
    )
    if analyze == "empty":
        query(ledger, "ANALYZE outbox, users, channels")
    query(
        ledger,
        """INSERT INTO outbox (user_id, run_id, epoch, body, status, delivery_id, fixed_at, attempts,
                              delivered_at, channel)
           SELECT 'u' || lpad((i %% %s)::text, 5, '0'), i, 1, 'old', 'delivered', gen_random_uuid(), %s, 1, %s, 'log'
           FROM generate_series(1, %s) i""",
        (USERS, T0 - timedelta(hours=2), T0 - timedelta(hours=2), HISTORY),
    )
    if analyze == "history":
        query(ledger, "ANALYZE outbox, users, channels")
    query(
        ledger,
        """INSERT INTO outbox (user_id, run_id, epoch, body)
           SELECT 'u' || lpad((i * 10)::text, 5, '0'), 0, 1, 'new' FROM generate_series(0, %s - 1) i""",
        (HELD,),
    )
    for offset, attempts, count in ((1, 1, LOST), (2, 5, BURIED)):
        query(
            ledger,
            """INSERT INTO outbox (user_id, run_id, epoch, body, status, delivery_id, fixed_at, attempts,
                                  next_attempt_at, channel)
               SELECT 'u' || lpad((i * 10 + %s)::text, 5, '0'), 0, 1, 'lost', 'sending', gen_random_uuid(), %s, %s, %s,
                      'log'
               FROM generate_series(0, %s - 1) i""",
            (offset, T0 - timedelta(minutes=5), attempts, T0 - timedelta(minutes=1), count),
        )


def claimed_with_plans(ledger: str, plan_cache_mode: str, limits: Limits):
    """One claim and an outcome of each kind for its first deliveries, every statement's
    executed plan kept (auto_explain), then rolled back: the claim's transaction is a
    savepoint of an outer one."""
    plans: list[dict] = []
    settings, keep = auto_explain(plan_cache_mode, plans)
    with psycopg.connect(explaining(ledger), row_factory=dict_row) as conn:
        conn.add_notice_handler(keep)
        for setting in settings:
            conn.execute(setting)
        claimed = claim(conn, T0, limits)
        first, second, third, fourth = claimed.deliveries[:4]
        recorded = [
            *record_delivered(conn, [first, fourth], T0),
            record_retry(conn, second, T0 + timedelta(seconds=30), "503"),
            record_dead(conn, third, T0, "410"),
        ]
        assert all(r.stood for r in recorded), recorded
        conn.rollback()
    return claimed, plans


@pytest.mark.parametrize("analyze", ["history", "empty"])
def test_a_dispatcher_claim_reads_what_it_claims_whatever_the_statistics_and_the_backlog(ledger, analyze):
    seed(ledger, analyze)
    unfinished = HELD + LOST + BURIED
    limits = Limits(default_gap_s=GAP_S, default_urgent_cap=3, max_attempts=5, lease_s=60, batch_users=100)
    for mode in ("force_custom_plan", "force_generic_plan"):
        claimed, plans = claimed_with_plans(ledger, mode, limits)
        # Oldest delivery first, then by user: u00000 (held), u00001 (lost), u00002 (buried),
        # u00010, ..., u00092, then held and lost by turns from u00100.
        assert claimed.users_locked == 100, mode
        assert (len(claimed.deliveries), len(claimed.lost), len(claimed.buried)) == (90, 45, 10), mode
        assert len(plans) == 9, mode  # lock, read, fix, pace, re-arm, bury, three outcomes
        for plan in plans:
            text = plan["Query Text"].strip().split("\n")[0]
            # Every step reads what it claims or records, by index probes: not the history,
            # not every user, not every unfinished row (a pass that read the whole backlog,
            # or an outcome that did, would make draining a backlog quadratic).
            assert _max_rows_read_per_node(plan["Plan"]) <= 2 * limits.batch_users, (mode, text, unfinished)
            scans = {(n["Node Type"], n.get("Relation Name")) for n in _nodes(plan["Plan"])}
            assert not {s for s in scans if s[0] == "Seq Scan"}, (mode, text, scans)


@pytest.mark.parametrize("analyze", ["history", "empty"])
def test_a_claim_between_sweeps_reads_only_the_new_messages(ledger, analyze):
    """Between sweeps a claim looks only at users with unfinished rows written after the mark
    (the outbox's highest id when it last looked) and at users named to it (their delivery
    just ended): the 2,060 waiting rows are not read, and of those users it takes the ones
    with something to send (here all: their gap passed)."""
    seed(ledger, analyze)
    limits = Limits(default_gap_s=GAP_S, default_urgent_cap=3, max_attempts=5, lease_s=60, batch_users=100)
    for first, mode in ((USERS - 19, "force_custom_plan"), (USERS - 9, "force_generic_plan")):
        fresh = [user(i) for i in range(first, first + 9)]  # u19981 .., u19991 ..: nothing waiting yet
        plans: list[dict] = []
        settings, keep = auto_explain(mode, plans)
        with psycopg.connect(explaining(ledger), row_factory=dict_row) as conn:
            mark = conn.execute("SELECT max(id) AS high FROM outbox").fetchone()["high"]
            for u in fresh:
                conn.execute("INSERT INTO outbox (user_id, run_id, epoch, body) VALUES (%s, 0, 1, 'new')", (u,))
            high = conn.execute("SELECT max(id) AS high FROM outbox").fetchone()["high"]
            conn.add_notice_handler(keep)
            for setting in settings:
                conn.execute(setting)
            claimed = claim(conn, T0, limits, fresh_after=mark, recheck=[user(0)])  # its delivery just ended
            conn.rollback()
        assert sorted(d.user_id for d in claimed.deliveries) == [user(0), *fresh], mode
        assert claimed.high == high, mode
        assert len(claimed.missing) == high - mark - len(fresh), "ids taken and rolled back have no row"
        (lock, *_) = plans
        # Proportional to the ids after the mark (here also the first round's, rolled back:
        # ids without a row, which the statement reports missing), never to the backlog.
        assert _max_rows_read_per_node(lock["Plan"]) <= 2 * (high - mark), mode
        for plan in plans:
            scans = {(n["Node Type"], n.get("Relation Name")) for n in _nodes(plan["Plan"])}
            assert not {s for s in scans if s[0] == "Seq Scan"}, (mode, plan["Query Text"][:80], scans)


def test_due_users_are_those_with_something_to_send_now(ledger):
    """The prefilter's meaning, user by user: an expired lease or backoff; held messages past
    the gap, or urgent ones inside it; nothing behind a delivery still in flight. Between
    sweeps the users not due are reported with when they may be."""
    query(
        ledger,
        """INSERT INTO users (user_id, home_topic, home_partition, last_delivery_at) VALUES
           ('past-gap', 'events', 0, %(long_ago)s), ('never-sent', 'events', 0, NULL),
           ('in-gap', 'events', 0, %(just_now)s), ('in-gap-urgent', 'events', 0, %(just_now)s),
           ('own-gap-passed', 'events', 0, %(just_now)s), ('behind-a-send', 'events', 0, %(long_ago)s),
           ('lease-over', 'events', 0, %(just_now)s), ('backoff-over', 'events', 0, %(just_now)s),
           ('backoff-on', 'events', 0, %(long_ago)s), ('all-delivered', 'events', 0, %(long_ago)s)""",
        {"long_ago": T0 - timedelta(hours=1), "just_now": T0 - timedelta(seconds=30)},
    )
    query(ledger, "INSERT INTO channels (user_id, type, gap_seconds) VALUES ('own-gap-passed', 'log', 10)")
    held = ["past-gap", "never-sent", "in-gap", "own-gap-passed", "behind-a-send"]
    for u in held:
        query(ledger, "INSERT INTO outbox (user_id, run_id, epoch, body) VALUES (%s, 0, 1, 'held')", (u,))
    query(ledger, "INSERT INTO outbox (user_id, run_id, epoch, body, urgent) VALUES ('in-gap-urgent', 0, 1, 'u', true)")
    fixed = """INSERT INTO outbox (user_id, run_id, epoch, body, status, delivery_id, fixed_at, attempts,
                                   next_attempt_at, channel, delivered_at)
               VALUES (%s, 0, 1, 'fixed', %s, gen_random_uuid(), %s, 1, %s, 'log', %s)"""
    earlier = T0 - timedelta(minutes=5)
    query(ledger, fixed, ("behind-a-send", "sending", earlier, T0 + timedelta(seconds=30), None))
    query(ledger, fixed, ("lease-over", "sending", earlier, T0 - timedelta(seconds=1), None))
    query(ledger, fixed, ("backoff-over", "pending", earlier, T0, None))
    query(ledger, fixed, ("backoff-on", "pending", earlier, T0 + timedelta(seconds=1), None))
    query(ledger, fixed, ("all-delivered", "delivered", earlier, None, earlier))
    everyone = held + ["in-gap-urgent", "lease-over", "backoff-over", "backoff-on", "all-delivered", "unknown"]
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        swept = outbox.lock_due_users(conn, now=T0, default_gap_s=GAP_S, limit=100)
        conn.rollback()
        # Between sweeps (here: no new rows, every user named): the same users, and those that
        # hold messages not due yet with the moment that may change.
        looked = outbox.lock_due_users(
            conn, now=T0, default_gap_s=GAP_S, limit=100, fresh_after=10**9, fresh_max=10, recheck=everyone
        )
        conn.rollback()
    due = {"past-gap", "never-sent", "in-gap-urgent", "own-gap-passed", "lease-over", "backoff-over"}
    assert {row.user_id for row in swept.users} == due
    assert swept.waits == [], "a sweep reads every holder anyway"
    assert {row.user_id for row in looked.users} == due
    assert dict(looked.waits) == {
        "in-gap": T0 - timedelta(seconds=30) + timedelta(seconds=GAP_S),  # its gap's end
        "behind-a-send": T0 + timedelta(seconds=30),  # the send's lease
        "backoff-on": T0 + timedelta(seconds=1),  # the retry's backoff
    }


def test_claims_sweep_the_due_users_in_turn_and_wrap_around(ledger):
    """A pass takes the next due users after the previous pass's last one (a round robin), so
    every due user gets its turn within one sweep however many wait; users waiting out their
    gap are passed over without filling the limit; the sweep starts again from the first user."""
    users = [f"r{i:02d}" for i in range(10)]
    for i, u in enumerate(users):
        # Every third user was just delivered to: held, not due.
        last = T0 - (timedelta(seconds=30) if i % 3 == 0 else timedelta(hours=2))
        query(
            ledger,
            "INSERT INTO users (user_id, home_topic, home_partition, last_delivery_at) VALUES (%s, 'e', 0, %s)",
            (u, last),
        )
        query(ledger, "INSERT INTO outbox (user_id, run_id, epoch, body) VALUES (%s, 0, 1, 'held')", (u,))
    due = [u for i, u in enumerate(users) if i % 3 != 0]  # r01 r02 r04 r05 r07 r08
    passes = []
    after = ""
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        for _ in range(4):
            found = outbox.lock_due_users(conn, now=T0, default_gap_s=GAP_S, limit=4, after=after)
            conn.rollback()
            passes.append(([row.user_id for row in found.users], found.cursor))
            after = found.cursor
    assert (
        passes
        == [
            (due[:4], due[3]),  # full: the next pass continues after r05
            (due[4:], ""),  # short: the sweep reached the last user
            (due[:4], due[3]),
            (due[4:], ""),
        ]
    )
