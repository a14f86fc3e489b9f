"""The claim written once per run (issue 12 point 2): what the claim and the finish write, and
that their plans read the work at hand, not every claim in flight.

Counted with PostgreSQL's own per-transaction statistics (pg_stat_xact_user_tables) and its
plans (EXPLAIN ANALYZE), as tests/test_worker_claims.py bounds the claim pass.
"""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
from psycopg.rows import dict_row

from support import query
from test_worker_claims import HOME, _max_rows_per_node, seed_pending
from vigil.agent.base import EventRow, OutMessage, RunResult
from vigil.ledger.finish import finish_runs_params
from vigil.ledger.queries import Q
from vigil.ledger.states import RunOutcome
from vigil.worker.claims import Claim
from vigil.worker.finish import Finished, run_record

OWNED = {"topics": ["events"], "partitions": [0], "epochs": [1]}
CLAIM = {**OWNED, "busy": [], "batch_max": 50, "window_s": 0.0, "max_attempts": 3, "until": None}


def writes(conn: psycopg.Connection) -> dict[str, tuple[int, int, int]]:
    """(inserted, updated, deleted) rows per table so far in this transaction."""
    rows = conn.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_xact_user_tables"
        " WHERE n_tup_ins + n_tup_upd + n_tup_del > 0"
    ).fetchall()
    return {r["relname"]: (r["n_tup_ins"], r["n_tup_upd"], r["n_tup_del"]) for r in rows}


def test_a_claim_writes_one_row_per_run_and_no_event_row(ledger):
    users = seed_pending(ledger, 5, per_user=3)
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        claimed = conn.execute(Q.claim, {**CLAIM, "after": "", "max_users": 10}).fetchall()
        assert len(claimed) == 15
        assert writes(conn) == {"claims": (5, 0, 0)}
        conn.commit()
    # Operators see the rows running, their attempt counted, under the claim's epoch.
    rows = query(ledger, "SELECT user_id, status, attempts, claim_epoch FROM events ORDER BY id")
    assert {(r["status"], r["attempts"], r["claim_epoch"]) for r in rows} == {("running", 1, 1)}
    assert {r["user_id"] for r in rows} == set(users)
    # Rule 4 from the claims' key: a second pass takes nobody.
    assert query(ledger, Q.claim, {**CLAIM, "after": "", "max_users": 10}) == []


def finished_runs(ledger: str, users: list[str], outcome=RunOutcome.MESSAGE) -> list[Finished]:
    ids = {
        r["user_id"]: r["id"] for r in query(ledger, "SELECT user_id, id FROM events WHERE user_id = ANY(%s)", (users,))
    }
    now = datetime.now(UTC)
    return [
        Finished(
            Claim(
                user,
                HOME,
                1,
                [EventRow(event_id, user, "chat", f"{user}-1", "chat.message", "{}", None, now, 1)],
                0,
                now,
            ),
            datetime(2020, 1, 1, tzinfo=UTC),
            result=RunResult(outcome, messages=[OutMessage("hi")]),
        )
        for user, event_id in ids.items()
    ]


def test_the_finish_moves_each_event_once_and_deletes_the_claims(ledger):
    users = seed_pending(ledger, 5, status="running")
    runs = finished_runs(ledger, users)
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        written = conn.execute(Q.finish_runs, finish_runs_params([run_record(r) for r in runs], "w")).fetchall()
        assert sorted(r["done"] for r in written) == [1] * 5
        counts = writes(conn)
        conn.commit()
    # Each event leaves the live queue once (a move: deleted there, inserted into its day); the
    # claim rows go; nothing else touches the queue.
    assert counts["events_live"] == (0, 0, 5)
    assert counts["claims"] == (0, 0, 5)
    assert sum(ins for name, (ins, _, _) in counts.items() if name.startswith("events_finished")) == 5
    rows = query(ledger, "SELECT status, attempts, claim_epoch FROM events")
    assert {(r["status"], r["attempts"], r["claim_epoch"]) for r in rows} == {("done", 1, 1)}


def test_the_claim_and_finish_read_their_runs_not_every_claim_in_flight(ledger):
    """3,000 users hold claims (runs in flight), 3,000 more wait: a pass of 10 and a finish of
    20 stay near their own size in every plan node, as do the rare paths that end claims."""
    running = seed_pending(ledger, 3000, status="running")
    waiting = [f"w{i:05d}" for i in range(3000)]
    query(
        ledger,
        "INSERT INTO users (user_id, home_topic, home_partition) SELECT unnest(%s::text[]), 'events', 0",
        (waiting,),
    )
    query(
        ledger,
        """INSERT INTO event_rows (user_id, source, source_id, kind, received_at, recorded_at)
           SELECT u, 'chat', u || '-1', 'chat.message', now(), now() - interval '1 hour'
           FROM unnest(%s::text[]) AS u""",
        (waiting,),
    )
    query(ledger, "ANALYZE event_rows")
    query(ledger, "ANALYZE claims")

    def plan(sql: str, params: dict) -> dict:
        with psycopg.connect(ledger, row_factory=dict_row) as conn:
            found = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()["QUERY PLAN"][0]["Plan"]
            conn.rollback()
        return found

    # The waiting users sort after the running ones: a pass from the start skips the busy ones
    # by the runner's own list, never by reading their claims.
    claim = plan(Q.claim, {**CLAIM, "busy": running, "after": "w01000", "max_users": 10})
    assert _max_rows_per_node(claim) <= 50
    finish = plan(Q.finish_runs, finish_runs_params([run_record(r) for r in finished_runs(ledger, running[:20])], "w"))
    assert _max_rows_per_node(finish) <= 100
    some = running[:1]
    for name, sql, params in (
        (
            "finish_failed",
            Q.finish_failed,
            {
                "user_id": some[0],
                "ids": [1],
                "epoch": 1,
                "error": "x",
                "run_id": None,
                "backoff_s": 1.0,
                "transient": False,
            },
        ),
        (
            "release_claim",
            Q.release_claim,
            {"user_id": some[0], "ids": [1], "epoch": 1, "topic": "events", "partition": 0},
        ),
        (
            "claim_more",
            Q.claim_more,
            {"topic": "events", "partition": 0, "epoch": 1, "user_id": some[0], "sources": ["chat"]},
        ),
        ("mark_exhausted_dead", Q.mark_exhausted_dead, {**OWNED, "max_attempts": 3}),
        ("alone_due", Q.alone_due, {**OWNED, "max_attempts": 3}),
        ("claim_alone", Q.claim_alone, {**OWNED, "max_attempts": 3}),
    ):
        assert _max_rows_per_node(plan(sql, params)) <= 100, name


def test_a_takeover_hands_back_only_the_lost_claims_and_counts_their_attempt(ledger):
    users = seed_pending(ledger, 3, per_user=2, status="running")
    query(ledger, "UPDATE claims SET epoch = 2 WHERE user_id = %s", (users[2],))  # claimed under the new epoch
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        handed = conn.execute(
            Q.hand_back_stale_claims,
            {"topic": "events", "partition": 0, "epoch": 2, "max_attempts": 3, "backoff_cap": 1.0, "backoff_base": 1.0},
        ).fetchall()
        assert len(handed) == 4
        counts = writes(conn)
        conn.commit()
    assert counts == {"claims": (0, 0, 2), "events_live": (0, 4, 0)}
    rows = query(ledger, "SELECT user_id, status, attempts, lost_claims FROM events ORDER BY id")
    assert [(r["status"], r["attempts"], r["lost_claims"]) for r in rows if r["user_id"] != users[2]] == [
        ("pending", 1, 1)
    ] * 4
    assert {(r["status"], r["attempts"]) for r in rows if r["user_id"] == users[2]} == {("running", 1)}
