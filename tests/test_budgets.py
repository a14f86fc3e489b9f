"""Daily token budgets (docs/agent.md, "Budgets"): a run refused for its user's budget leaves
no run behind, a real worker waits and resumes, and one weighting bills tokens everywhere."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import psycopg
from psycopg.rows import dict_row

from ingest_support import cli
from support import query, scalar, wait_for
from vigil.agent.base import RunResult
from vigil.agent.settings import DEFAULT_INSTRUCTIONS_PATH
from vigil.ledger import budgets
from vigil.ledger.states import RunOutcome
from vigil.worker.finish import Finished, commit_finished
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer
from worker_support import chat, claude_env, metric, produce

SCRIPT = {
    "rules": [
        {"when": {"tool_result": "send_message"}, "reply": []},
        {
            "when": {"user_text": "hello"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Hi!", "urgent": False}}],
        },
    ]
}


def test_a_run_refused_for_the_budget_leaves_no_run_row(ledger):
    """A refused run was never started: its events wait (pending, the claim's attempt given
    back), and no runs row counts it as a failure; a neighbour in the same group commits."""
    from test_worker_claims import claim_pass, seed_pending  # the claim rules' own seeding

    seed_pending(ledger, 2)
    claims, _ = claim_pass(ledger, 2, "")
    refused, ran = sorted(claims, key=lambda c: c.user_id)
    started = datetime.now(UTC)
    group = [
        Finished(refused, started, error="budget: spent (1600 of 1500)", waiting=True, backoff_s=3600),
        Finished(ran, started, result=RunResult(RunOutcome.NOTHING)),
    ]

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await commit_finished(conn, group, "test-worker")

    committed, stale = asyncio.run(go())
    assert len(committed) == 2 and not stale
    assert [r["user_id"] for r in query(ledger, "SELECT user_id FROM runs")] == [ran.user_id]
    assert scalar(ledger, "SELECT count(*) FROM runs WHERE outcome = 'failed'") == 0
    [waiting] = query(
        ledger,
        "SELECT status, attempts, transient_failures, error, run_id,"
        " next_attempt_at > now() + interval '59 minutes' AS later FROM events WHERE user_id = %s",
        (refused.user_id,),
    )
    assert waiting["status"] == "pending" and (waiting["attempts"], waiting["transient_failures"]) == (0, 0)
    assert waiting["later"] and waiting["error"].startswith("budget: ") and waiting["run_id"] is None


def test_a_worker_past_the_budget_calls_no_model_tells_once_and_resumes_when_raised(
    spawn, vigil_env, ledger, stack, topics
):
    """A real worker, a profile of 1,500 billed tokens a day: the first run passes it; what
    arrives next makes no model call, is no run and no attempt, and the user is told once;
    `vigil profiles update --daily-tokens` raising the budget releases the waiting events at
    once, and they run (each with the one attempt that ran it); the notice, not sent yet, is
    withdrawn."""
    user = "bud/carol"
    cli(ledger, "profiles", "create", "tight", "--daily-tokens", "1500", "--system-prompt", "Spend little.")
    cli(ledger, "profiles", "assign", "bud/*", "tight")
    with ScriptedServer(SCRIPT) as server:
        env = claude_env(vigil_env, server.base_url)
        port = int(env["VIGIL_WORKER_PORT"])
        spawn(["worker"], env, name="worker").wait_healthy(port)

        def replies() -> int:
            return scalar(ledger, "SELECT count(*) FROM outbox WHERE user_id = %s AND run_id <> 0", (user,))

        produce(stack.bootstrap, topics.events, [chat(user, "hello 1")])
        wait_for(lambda: replies() == 1, 60, "the first run's reply", interval=0.2)
        calls = len(server.requests())
        assert calls >= 1

        produce(stack.bootstrap, topics.events, [chat(user, "hello 2"), chat(user, "hello 3")])

        def refused() -> int:
            return scalar(
                ledger,
                "SELECT count(*) FROM events WHERE user_id = %s AND status = 'pending' AND error LIKE 'budget: %%'"
                " AND next_attempt_at > now() + interval '1 minute'",
                (user,),
            )

        wait_for(lambda: refused() == 2, 60, "both events waiting for the budget", interval=0.2)
        # A few more claim passes (counted, not slept for): none may call the model.
        passes = metric(port, "vigil_worker_ledger_seconds_count", 'step="claim"')
        assert passes > 0
        wait_for(
            lambda: metric(port, "vigil_worker_ledger_seconds_count", 'step="claim"') >= passes + 3,
            60,
            "three more claim passes",
        )
        assert len(server.requests()) == calls  # no model call past the budget
        notices = query(ledger, "SELECT body FROM outbox WHERE user_id = %s AND run_id = 0", (user,))
        assert len(notices) == 1 and "daily model budget (1500 tokens) is spent" in notices[0]["body"]
        assert scalar(ledger, "SELECT count(*) FROM runs") == 1  # the refusal is no run
        assert metric(port, "vigil_budget_exhausted_total", 'profile="tight"') >= 1
        assert metric(port, "vigil_runs_total", 'outcome="failed"') == 0
        assert metric(port, "vigil_budget_tokens", 'profile="tight"') == 1500

        cli(ledger, "profiles", "update", "tight", "--daily-tokens", "100000")
        wait_for(lambda: replies() == 2, 60, "the waiting events' run after the budget was raised", interval=0.2)
        assert len(server.requests()) > calls
        assert metric(port, "vigil_budget_tokens", 'profile="tight"') == 100_000
        rows = query(ledger, "SELECT status, attempts, transient_failures FROM events WHERE user_id = %s", (user,))
        assert [(r["status"], r["attempts"], r["transient_failures"]) for r in rows] == [("done", 1, 0)] * 3
        assert scalar(ledger, "SELECT count(*) FROM runs WHERE outcome = 'failed'") == 0
        # The notice was still queued (no dispatcher runs here): withdrawn by the raise, not sent late.
        assert scalar(ledger, "SELECT count(*) FROM outbox WHERE user_id = %s AND run_id = 0", (user,)) == 0
        assert scalar(ledger, "SELECT count(*) FROM budget_notices WHERE user_id = %s", (user,)) == 0


def test_raising_the_budget_keeps_a_notice_whose_send_began(ledger):
    """Only a notice no send has begun is withdrawn: one the dispatcher fixed a delivery id for
    may have reached the user, so it stays (and so does the record that they were told)."""
    with psycopg.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
        for user in ("bud/ann", "bud/bob"):
            conn.execute(
                "INSERT INTO events (user_id, source, source_id, kind, received_at, status, error, next_attempt_at)"
                " VALUES (%s, 'chat', %s, 'chat.message', now(), 'pending', 'budget: spent',"
                " now() + interval '1 hour')",
                (user, user),
            )
            asyncio.run(_notify(ledger, user))
        conn.execute("UPDATE outbox SET delivery_id = gen_random_uuid(), fixed_at = now() WHERE user_id = 'bud/bob'")
    cli(ledger, "profiles", "create", "tight", "--daily-tokens", "1500")
    cli(ledger, "profiles", "assign", "bud/*", "tight")
    cli(ledger, "profiles", "update", "tight", "--daily-tokens", "9000")
    assert [r["user_id"] for r in query(ledger, "SELECT user_id FROM outbox WHERE run_id = 0")] == ["bud/bob"]
    assert [r["user_id"] for r in query(ledger, "SELECT user_id FROM budget_notices")] == ["bud/bob"]
    [detail] = query(ledger, "SELECT detail FROM audit WHERE action = 'profile.update'")
    assert (detail["detail"]["released"], detail["detail"]["withdrawn_notices"]) == (2, 1)


async def _notify(ledger: str, user: str) -> None:
    async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
        await budgets.notify_once(conn, user_id=user, day=datetime.now(UTC).date(), profile="tight", body="spent")


def test_a_runs_token_cap_counts_cache_reads_as_billed():
    """A run of six turns over a large cached prompt (about 5,500 tokens: tools and 4,000 of
    instructions): counted raw, each turn after the first costs the whole prefix again and a
    cap of 14,000 stopped the run after three; billed as the daily budget bills it (cache
    reads 0.1x, writes 1.25x), the six cost about 10,500 and the run ends on its own."""
    script = {
        "rules": [
            {
                "when": {"user_text": "count"},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "1"}}],
            },
            {
                "when": {"tool_result": "send_message"},
                "times": 4,
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "more"}}],
            },
            {"when": {"tool_result": "send_message"}, "reply": []},
        ]
    }
    instructions = "Keep every answer short and number it. " * 400  # 16,000 bytes: about 4,000 tokens
    with ScriptedServer(script) as server:
        ctx = t.context([t.chat("count to five")], memory={DEFAULT_INSTRUCTIONS_PATH: instructions})
        [result] = t.run(server.base_url, ctx, max_run_tokens=14_000)
    u = result.usage
    assert u.turns == 6 and len(result.messages) == 5, (u, result.messages)
    assert u.cache_read_tokens > 20_000, u  # the later turns read the prompt from the cache
    assert u.input_tokens + u.output_tokens + u.cache_read_tokens + u.cache_write_tokens > 14_000, u
    assert budgets.billed(u) < 14_000


def test_open_background_tasks_hold_their_budget_until_they_end(ledger):
    """A run that starts while background tasks of its user work counts their whole budgets as
    spent: before, it saw only ended usage and the user's run and tasks together could spend
    the day's budget several times over."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    query(
        ledger,
        "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome,"
        " input_tokens) VALUES ('hold/ann', 'events', 0, 1, 'w', '{}', now(), now(), 'message', 500)",
    )
    for status, budget in (("queued", 300), ("running", 100), ("succeeded", 7000)):
        query(
            ledger,
            "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget,"
            " max_attempts, deadline, status, lease_holder, heartbeat_at, finished_at)"
            " VALUES (gen_random_uuid()::text, 'hold/ann', 'hold/ann:1', 1, '{hold/ann}', 'look', %s, 3,"
            " now() + interval '1 hour', %s, 'w', now(), CASE WHEN %s = 'succeeded' THEN now() END)",
            (budget, status, status),
        )

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, row_factory=dict_row) as conn:
            return await budgets.spent(conn, user_id="hold/ann", since=today)

    assert asyncio.run(go()) == 500 + 300 + 100
