"""The ledger's storage: the hot statements read the live queue (events_live) and never the
history of finished events (events_finished, a partition per day), however long the history.

Cost tests read PostgreSQL's own account of each statement (EXPLAIN ANALYZE, as
tests/test_worker_claims.py does): every relation in the plan, and the rows each node
touched. A statement that planned or scanned a month of day partitions would cost each claim
and finish a lock and an index probe per day (1.8 times the claim's time at 36 partitions,
measured while choosing this layout: docs/scaling.md).
"""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
from psycopg.rows import dict_row

from support import query
from test_worker_claims import HOME, _max_rows_per_node, seed_pending
from vigil.agent.base import EventRow, OutMessage, RunResult
from vigil.ledger.claims import Claim
from vigil.ledger.finish import finish_runs_params
from vigil.ledger.queries import Q
from vigil.ledger.states import RunOutcome
from vigil.worker.finish import Finished, run_record

HISTORY_DAYS = 31
OWNED = {"topics": ["events"], "partitions": [0], "epochs": [1]}


def seed_history(ledger: str, per_day: int = 1000) -> None:
    """A month of finished events, each day in its own partition."""
    query(
        ledger,
        "SELECT ensure_event_partitions(3, ARRAY(SELECT (now() AT TIME ZONE 'UTC')::date - g "
        "FROM generate_series(1, %s) AS g))",
        (HISTORY_DAYS,),
    )
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, received_at, recorded_at, status, finished_at,
                              attempts, claim_epoch)
           SELECT 'u' || lpad((g %% 500)::text, 5, '0'), 'chat', 'old-' || g, 'chat.message', t, t, 'done', t, 1, 1
           FROM generate_series(1, %(n)s) AS g,
                LATERAL (SELECT now() - (1 + g %% %(days)s) * interval '1 day' AS t) x""",
        {"n": per_day * HISTORY_DAYS, "days": HISTORY_DAYS},
    )
    query(ledger, "ANALYZE events")


def plan_of(ledger: str, sql: str, params: dict) -> dict:
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()["QUERY PLAN"][0]["Plan"]
        conn.rollback()
    return plan


def relations(plan: dict) -> set[str]:
    found = {plan["Relation Name"]} if "Relation Name" in plan else set()
    for child in plan.get("Plans", []):
        found |= relations(child)
    return found


def history_in(plan: dict) -> set[str]:
    return {name for name in relations(plan) if name.startswith("events_finished")}


def test_the_month_of_history_is_there(ledger):
    seed_history(ledger)
    days = query(
        ledger,
        "SELECT count(*) AS n FROM pg_inherits WHERE inhparent = 'events_finished'::regclass",
    )[0]["n"]
    assert days >= HISTORY_DAYS + 4  # the month, yesterday and today, the days ahead, the default
    assert query(ledger, "SELECT count(*) AS n FROM events_live")[0]["n"] == 0


def test_claim_and_rule_2_read_the_live_queue_only(ledger):
    seed_history(ledger)
    seed_pending(ledger, 3000, per_user=2)
    query(ledger, "UPDATE events SET attempts = 3 WHERE user_id = 'u00007' AND status = 'pending'")
    params = {
        **OWNED,
        "busy": "[]",  # a JSON array (claims.sql)
        "max_users": 10,
        "batch_max": 50,
        "window_s": 0.0,
        "max_attempts": 3,
        "after": "u01000",
        "until": None,
        "now": datetime.now(UTC),  # what the worker passes: its clock
    }
    for name, sql, args in (
        ("claim", Q.claim, params),
        ("mark_exhausted_dead", Q.mark_exhausted_dead, {**OWNED, "max_attempts": 3, "now": datetime.now(UTC)}),
        ("claim_alone", Q.claim_alone, {**OWNED, "max_attempts": 3, "now": datetime.now(UTC)}),
        ("alone_due", Q.alone_due, {**OWNED, "max_attempts": 3, "now": datetime.now(UTC)}),
    ):
        plan = plan_of(ledger, sql, args)
        assert history_in(plan) == set(), f"{name} plans the history: {sorted(history_in(plan))[:5]}"
        assert "events_live" in relations(plan), name
        assert _max_rows_per_node(plan) <= 100, name


def test_the_group_finish_and_the_takeover_read_the_live_queue_only(ledger):
    seed_history(ledger)
    users = seed_pending(ledger, 3000, status="running")
    ids = {
        r["user_id"]: r["id"]
        for r in query(ledger, "SELECT user_id, id FROM events WHERE user_id = ANY(%s)", (users[:20],))
    }
    now = datetime.now(UTC)
    row = lambda user, event_id: EventRow(event_id, user, "chat", f"{user}-1", "chat.message", "{}", None, now, 1)  # noqa: E731
    runs = [
        Finished(
            Claim(user, HOME, 1, [row(user, event_id)], 0, now),
            datetime(2020, 1, 1, tzinfo=UTC),
            result=RunResult(RunOutcome.MESSAGE, messages=[OutMessage("hi")]),
        )
        for user, event_id in ids.items()
    ]
    finish = plan_of(ledger, Q.finish_runs, finish_runs_params([run_record(r) for r in runs], "test-worker"))
    # The done rows move into today's day of events_finished (routing, not a plan node).
    assert history_in(finish) == set(), sorted(history_in(finish))[:5]
    assert _max_rows_per_node(finish) <= 100
    some = list(ids.values())[:5]
    for name, sql, args in (
        (
            "finish_failed",
            Q.finish_failed,
            {
                "ids": some,
                "epoch": 1,
                "error": "x",
                "run_id": None,
                "backoff_s": 1.0,
                "transient": False,
                "waiting": False,
                "now": now,
            },
        ),
        ("release_claim", Q.release_claim, {"ids": some, "epoch": 1, "topic": "events", "partition": 0}),
        (
            "hand_back_stale_claims",
            Q.hand_back_stale_claims,
            {
                "topic": "events",
                "partition": 0,
                "epoch": 2,
                "max_attempts": 3,
                "backoff_cap": 1.0,
                "backoff_base": 1.0,
                "verdict_s": 30.0,
                "now": now,
            },
        ),
    ):
        plan = plan_of(ledger, sql, args)
        assert history_in(plan) == set(), f"{name} plans the history: {sorted(history_in(plan))[:5]}"


def test_a_finished_event_moves_to_its_day_and_a_retried_dead_one_back_to_the_queue(ledger):
    seed_pending(ledger, 1)
    query(ledger, "UPDATE events SET status = 'dead', finished_at = now(), attempts = 3")
    day = "events_finished_p" + datetime.now(UTC).strftime("%Y%m%d")
    assert query(ledger, "SELECT tableoid::regclass::text AS part FROM events")[0]["part"] == day
    query(ledger, "UPDATE events SET status = 'pending', finished_at = NULL, attempts = 0 WHERE status = 'dead'")
    assert query(ledger, "SELECT tableoid::regclass::text AS part FROM events")[0]["part"] == "events_live"
