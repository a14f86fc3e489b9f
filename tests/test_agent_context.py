"""The ledger side of a Claude run against a real database: what load_context_parts reads
(and only for the run's user), what session_rows stores, and the invariant that a waiting
session always carries the call it waits on."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg.rows import dict_row

from support import query
from vigil.agent.base import RunResult, SessionSave
from vigil.agent.run_ledger import load_context_parts, load_contexts, session_rows
from vigil.ledger.agent import save_sessions
from vigil.ledger.queries import Q
from vigil_dev import agent_testing as t

PENDING = {
    "request_id": "apr-1",
    "tool_use_id": "toolu_1",
    "tool": "refund",
    "input": {"order_id": "A1", "amount": 5},
    "args_hash": "h",
    "due": "2030-01-01T00:00:00+00:00",
    "on_expiry": "deny",
    "summary": "refund 5",
    "reason": "",
    "order": ["toolu_1"],
    "results": [],
}
WAITING = SessionSave("ses-wait", "waiting", [{"role": "user", "content": "refund"}], 2, 1, PENDING)
OPEN = SessionSave("ses-open", "open", [{"role": "user", "content": "hi"}])


def store(dsn: str, user: str, result: RunResult) -> None:
    async def go():
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await save_sessions(conn, session_rows(user, result))

    asyncio.run(go())


def seed(dsn: str) -> None:
    store(dsn, "u1", RunResult(session=WAITING, other_sessions=[OPEN]))
    store(dsn, "intruder", RunResult(session=SessionSave("ses-other", "open", [])))
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO memory (user_id, path, content) VALUES ('u1', '/memories/a.md', 'A'), "
            "('intruder', '/memories/secret.md', 'S')"
        )
        conn.execute(
            "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome) "
            "VALUES ('u1', 't', 0, 1, 'w', '{}', now(), now(), 'message')"
        )
        for n, status in enumerate(["delivered", "delivered", "pending"]):
            conn.execute(
                "INSERT INTO outbox (user_id, run_id, epoch, body, status, delivered_at) "
                "VALUES ('u1', 1, 1, %s, %s, CASE WHEN %s = 'delivered' THEN now() + make_interval(secs => %s) END)",
                (f"said {n}", status, status, n),
            )
        conn.execute(
            Q.approval_create,
            {
                "request_id": "apr-1",
                "user_id": "u1",
                "session_id": "ses-wait",
                "run_id": None,
                "tool": "refund",
                "tool_use_id": "toolu_1",
                "args_hash": "h",
                "due": "2030-01-01T00:00:00+00:00",
                "on_expiry": "deny",
            },
        )
        conn.execute("UPDATE approvals SET answer = 'yes', answered_at = now() WHERE request_id = 'apr-1'")


def load(dsn: str, ctx) -> None:
    async def go():
        async with await psycopg.AsyncConnection.connect(dsn, row_factory=dict_row) as conn:
            await load_context_parts(conn, ctx, recent_limit=5)

    asyncio.run(go())


def test_load_context_parts_reads_the_users_own_rows(ledger):
    seed(ledger)
    events = [
        t.event("approval.answer", {"request_id": "apr-1", "answer": "yes"}, source="approval", session_id="ses-wait"),
        t.chat("and also", session_id="ses-open"),
        t.chat("not mine", session_id="ses-other"),
    ]
    ctx = t.context(events)
    load(ledger, ctx)

    assert list(ctx.sessions) == ["ses-wait", "ses-open"]  # ses-other belongs to someone else
    waiting = ctx.sessions["ses-wait"]
    assert (waiting.state, waiting.pending, waiting.blocks, waiting.consecutive_blocks) == ("waiting", PENDING, 2, 1)
    assert ctx.session == waiting
    assert ctx.memory == {"/memories/a.md": "A"}
    assert ctx.recent_messages == ["said 0", "said 1"]  # delivered only, oldest first
    request = ctx.approval_requests["apr-1"]
    assert (request.session_id, request.tool, request.args_hash, request.answer) == ("ses-wait", "refund", "h", "yes")
    assert ctx.approvals == {"apr-1": "yes"}


def test_a_claim_pass_loads_many_contexts_in_one_pipeline_each_its_own_users(ledger):
    """The worker reads a whole claim pass's contexts together: each run gets exactly what
    load_context_parts would give it alone, never a neighbour's rows."""
    seed(ledger)
    mine = t.context(
        [
            t.event(
                "approval.answer", {"request_id": "apr-1", "answer": "yes"}, source="approval", session_id="ses-wait"
            ),
            t.chat("and also", session_id="ses-open"),
        ]
    )
    alone = t.context(list(mine.events))
    theirs = t.context([t.chat("hello", user_id="intruder", session_id="ses-other")], user_id="intruder")
    nobody = t.context([t.chat("first time", user_id="new")], user_id="new")

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, row_factory=dict_row, autocommit=True) as conn:
            await load_contexts(conn, [mine, theirs, nobody], recent_limit=5)

    asyncio.run(go())
    load(ledger, alone)

    for field in ("sessions", "session", "memory", "recent_messages", "approval_requests", "approvals"):
        assert getattr(mine, field) == getattr(alone, field), field
    assert mine.memory == {"/memories/a.md": "A"} and mine.approvals == {"apr-1": "yes"}
    assert list(theirs.sessions) == ["ses-other"] and theirs.memory == {"/memories/secret.md": "S"}
    assert theirs.recent_messages == [] and theirs.approvals == {}
    assert (nobody.sessions, nobody.memory, nobody.recent_messages) == ({}, {}, [])


def test_a_claim_pass_reads_each_users_queued_messages_policies_and_dead_events(ledger):
    """The statements that read all of a pass's users at once keep every row with its user:
    queued messages, policies and dead events (only those since the user's last run that did
    not fail, oldest first, at most the limit)."""
    seed(ledger)
    with psycopg.connect(ledger) as conn:
        conn.execute(Q.agent_policies_set, {"user_id": "intruder", "event_policies": "chat=fold"})
        conn.execute(
            "INSERT INTO events (user_id, source, source_id, kind, received_at, status, attempts, finished_at, error)"
            " SELECT u, 'billing', u || '-' || n, 'billing.invoice_paid', now() - interval '1 h', 'dead', 5,"
            "        timestamptz '2030-01-01 00:00:00Z' + make_interval(secs => n), 'poison ' || n"
            " FROM unnest(ARRAY['u1', 'intruder']) AS u, generate_series(1, 25) AS n"
        )
        # u1's last run started before its dead events: it hears of them; a failed run later does not count.
        conn.execute(
            "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome)"
            " VALUES ('u1', 't', 0, 1, 'w', '{}', '2031-01-01Z', '2031-01-01Z', 'failed'),"
            "        ('intruder', 't', 0, 1, 'w', '{}', '2030-01-01 00:00:20Z', '2030-01-01 00:00:21Z', 'message')"
        )
    mine = t.context([t.chat("again")])
    theirs = t.context([t.chat("hello", user_id="intruder")], user_id="intruder")

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, row_factory=dict_row, autocommit=True) as conn:
            await load_contexts(conn, [theirs, mine], recent_limit=5)

    asyncio.run(go())
    assert (mine.recent_messages, mine.queued_messages) == (["said 0", "said 1"], ["said 2"])
    assert (theirs.recent_messages, theirs.queued_messages) == ([], [])
    assert (mine.event_policies, theirs.event_policies) == ("", "chat=fold")
    assert [d["error"] for d in mine.dead_events] == [f"poison {n}" for n in range(1, 21)]  # oldest 20 of 25
    assert [d["error"] for d in theirs.dead_events] == [f"poison {n}" for n in range(21, 26)]  # after its run
    assert set(mine.dead_events[0]) == {"id", "source", "kind", "received_at", "attempts", "error"}


def test_sessions_are_stored_with_their_pending_call_and_resaved(ledger):
    seed(ledger)
    store(
        ledger,
        "u1",
        RunResult(session=SessionSave("ses-wait", "open", WAITING.messages + [{"role": "user", "content": "x"}])),
    )
    rows = {r["id"]: r for r in query(ledger, "SELECT id, user_id, state, pending, size_bytes, blocks FROM sessions")}
    assert rows["ses-wait"]["state"] == "open" and rows["ses-wait"]["pending"] is None
    assert rows["ses-wait"]["size_bytes"] > 0
    assert rows["ses-open"]["state"] == "open"
    # An upsert never takes over another user's session.
    store(ledger, "intruder", RunResult(session=SessionSave("ses-open", "closed", [])))
    assert query(ledger, "SELECT user_id, state FROM sessions WHERE id = 'ses-open'") == [
        {"user_id": "u1", "state": "open"}
    ]


def test_a_waiting_session_without_its_call_is_refused(ledger):
    with pytest.raises(psycopg.errors.CheckViolation, match="sessions_waiting_has_pending"):
        store(ledger, "u1", RunResult(session=SessionSave("ses-x", "waiting", [])))
