"""Agent profiles (docs/agent.md, "Profiles"): made with `vigil profiles` against a real ledger,
assigned by user patterns, read by a real agent whose model requests go to the scripted
Messages API, versioned so that a resumed session keeps the version it began with."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from support import query, scalar
from vigil.agent import profiles
from vigil.agent.base import OverBudget, RunResult
from vigil.clock import ManualClock, utc
from vigil.ledger import budgets, db
from vigil.ledger import finish as ledger_finish
from vigil.ledger.states import RunOutcome
from vigil.worker.finish import Finished, run_record
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

MCP_TEST_SERVER = Path(__file__).resolve().parent / "mcp_test_server.py"
SCRIPT = {
    "rules": [
        {"when": {"tool_result": "send_message"}, "reply": []},
        {
            "when": {"user_text": "hello"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Hi!", "urgent": False}}],
        },
    ]
}


def vigil(ledger: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VIGIL_DATABASE_URL": ledger}
    done = subprocess.run([sys.executable, "-m", "vigil", *args], env=env, capture_output=True, text=True, timeout=60)
    return done


def ok(ledger: str, *args: str) -> dict:
    done = vigil(ledger, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(SCRIPT) as s:
        yield s


def seen(request: dict) -> tuple[str, str, list[str]]:
    """What one model request carried: model, first system block, tool names."""
    return request["model"], request["system"][0]["text"], [tool["name"] for tool in request["tools"]]


def run_all(server, ledger: str, ctxs, **overrides) -> list:
    async def go():
        pool = db.async_pool(ledger, name="w0", max_size=2, autocommit=True)
        await pool.open(wait=True)
        agent = t.agent(server.base_url, profile_cache_s=0, **overrides)
        await agent.join_fleet(pool, "worker-0")
        try:
            return [await agent.run(ctx) for ctx in ctxs]
        finally:
            await agent.close()
            await pool.close()

    return asyncio.run(go())


def test_most_specific_assignment_wins():
    patterns = ["team-a/*", "team-a/ops/*", "team-a/boss", "*"]
    assert profiles.most_specific(patterns, "team-a/boss") == "team-a/boss"
    assert profiles.most_specific(patterns, "team-a/ops/kim") == "team-a/ops/*"
    assert profiles.most_specific(patterns, "team-a/alice") == "team-a/*"
    assert profiles.most_specific(patterns, "team-b/bob") == "*"
    assert profiles.most_specific(["team-a/*"], "team-b/bob") is None


def test_two_profiles_on_two_patterns_and_versions_kept_by_resumed_sessions(server, ledger):
    server.clear()
    ok(
        ledger,
        "profiles",
        "create",
        "support",
        "--model",
        "claude-support",
        "--system-prompt",
        "You answer support.",
        "--tools",
        "send_message=allow,memory=allow",
    )
    ok(
        ledger,
        "profiles",
        "create",
        "sales",
        "--model",
        "claude-sales",
        "--system-prompt",
        "You sell.",
        "--tools",
        "send_message=allow,set_followup=allow",
        "--mcp-server",
        "crm",
        "--allow-unknown",  # a server the workers are given later
    )
    ok(ledger, "profiles", "assign", "team-a/*", "support")
    ok(ledger, "profiles", "assign", "team-b/*", "sales")
    ok(ledger, "profiles", "assign", "team-a/boss", "sales")  # exact id beats the pattern
    refused = vigil(ledger, "profiles", "assign", "team-*/x", "sales")
    assert refused.returncode != 0 and "only at the end" in refused.stderr
    assert vigil(ledger, "profiles", "create", "support").returncode == 4  # exists: update it
    typo = vigil(ledger, "profiles", "create", "typo", "--tools", "send_mesage=allow", "--mcp-server", "crm")
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert "no tool send_mesage, MCP server crm here" in typo.stderr and "--allow-unknown" in typo.stderr
    assert vigil(ledger, "profiles", "show", "typo").returncode == 1, "a refused profile was saved"

    users = ["team-a/alice", "team-b/bob", "team-a/boss", "other"]
    results = run_all(server, ledger, [t.context([t.chat(f"hello {u}")], user_id=u) for u in users])
    first = [seen(r) for r in server.requests() if not any("tool_result" in json.dumps(m) for m in r["messages"])]
    alice, bob, boss, other = first
    assert alice[0] == "claude-support" and "You answer support." in alice[1] and alice[2] == ["send_message", "memory"]
    assert bob[0] == "claude-sales" and "You sell." in bob[1] and bob[2] == ["send_message", "set_followup"]
    assert boss[:2] == bob[:2] and boss[2] == bob[2]
    # The default: the deployment's model, prompt and every tool it offers.
    assert other[0] == t.settings().model and "You sell." not in other[1] and "You answer" not in other[1]
    assert {"send_message", "set_followup", "memory", "delegate", "refund"} <= set(other[2])
    assert [r.profile for r in results] == [("support", 1), ("sales", 1), ("sales", 1), None]

    # An update makes version 2 and keeps version 1.
    v2 = ok(ledger, "profiles", "update", "support", "--system-prompt", "You answer support, v2.")
    assert v2["version"] == 2 and v2["spec"]["model"] == "claude-support"
    history = vigil(ledger, "profiles", "show", "support", "--history", "--json").stdout.splitlines()
    assert [json.loads(line)["version"] for line in history] == [1, 2]
    assert [r["action"] for r in query(ledger, "SELECT action FROM audit ORDER BY id")] == [
        "profile.create",
        "profile.create",
        "profile.assign",
        "profile.assign",
        "profile.assign",
        "profile.update",
    ]

    # Alice's session began under v1 (its run recorded as the worker's finish records it):
    # resuming it keeps v1; a fresh run of hers gets v2.
    session = t.saved(results[0])
    query(
        ledger,
        "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, session_id, started_at, finished_at,"
        " outcome, profile, profile_version) VALUES ('team-a/alice', 'events', 0, 1, 'w', '{1}', %s, now(), now(),"
        " 'message', 'support', 1)",
        (session.id,),
    )
    server.clear()
    resumed, fresh = run_all(
        server,
        ledger,
        [
            t.context([t.chat("hello again", session_id=session.id)], user_id="team-a/alice", sessions=[session]),
            t.context([t.chat("hello new")], user_id="team-a/alice"),
        ],
    )
    assert (resumed.profile, fresh.profile) == (("support", 1), ("support", 2))
    systems = [r["system"][0]["text"] for r in server.requests() if r["messages"][-1]["role"] == "user"]
    assert "You answer support.\n" in systems[0] and "v2" not in systems[0]
    assert "You answer support, v2." in systems[-1]
    assert scalar(ledger, "SELECT count(*) FROM profiles") == 3


@pytest.mark.slow  # two MCP servers started over stdio
def test_an_update_naming_an_unknown_tool_or_server_is_refused_and_saves_nothing(ledger):
    ok(ledger, "profiles", "create", "ops", "--tools", "send_message=allow")
    typo = vigil(ledger, "profiles", "update", "ops", "--tools", "send_mesage=allow", "--mcp-server", "crm")
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert "no tool send_mesage, MCP server crm here" in typo.stderr and "--allow-unknown" in typo.stderr
    history = vigil(ledger, "profiles", "show", "ops", "--history", "--json").stdout.splitlines()
    assert [json.loads(line)["version"] for line in history] == [1], "a refused update was saved"
    assert [r["action"] for r in query(ledger, "SELECT action FROM audit ORDER BY id")] == ["profile.create"]


def test_a_profiles_mcp_servers_choose_the_servers_its_runs_are_offered(server, ledger, tmp_path):
    """VIGIL_MCP_SERVERS names two servers (the test server twice, as orders and stock): a
    profile naming orders is offered orders' tools only, one naming stock only stock's; a
    profile naming none, and a user with no profile, are offered both."""
    log = tmp_path / "calls.jsonl"
    log.touch()
    command = {"command": sys.executable, "args": [str(MCP_TEST_SERVER), "stdio", str(log)]}
    ok(ledger, "profiles", "create", "ops", "--mcp-server", "orders", "--allow-unknown")
    ok(ledger, "profiles", "create", "warehouse", "--mcp-server", "stock", "--mcp-server", "gone", "--allow-unknown")
    ok(ledger, "profiles", "create", "plain", "--system-prompt", "Plain.")
    for pattern, name in (("team-o/*", "ops"), ("team-w/*", "warehouse"), ("team-p/*", "plain")):
        ok(ledger, "profiles", "assign", pattern, name)
    server.clear()
    users = ["team-o/olga", "team-w/wim", "team-p/pia", "other"]
    results = run_all(
        server,
        ledger,
        [t.context([t.chat(f"hello {u}")], user_id=u) for u in users],
        mcp_servers=json.dumps({"orders": command, "stock": command}),
    )
    assert [r.profile for r in results] == [("ops", 1), ("warehouse", 1), ("plain", 1), None]
    first = [seen(r) for r in server.requests() if not any("tool_result" in json.dumps(m) for m in r["messages"])]
    served = [sorted(name for name in tools if "__" in name) for _, _, tools in first]
    remote = ["big", "cancel_order", "crash_once", "lookup", "slow", "whereami"]
    orders, stock = [f"orders__{n}" for n in remote], [f"stock__{n}" for n in remote]
    assert served == [orders, stock, orders + stock, orders + stock]
    assert "send_message" in first[0][2] and "send_message" in first[1][2]  # only MCP tools are chosen


def record_run(ledger: str, user_id: str, result, started_at) -> None:
    """The run's row as the worker's finish writes it (its billed usage and profile)."""
    u = result.usage
    query(
        ledger,
        "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome,"
        " input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, profile, profile_version)"
        " VALUES (%s, 'events', 0, 1, 'w', '{1}', %s, %s, 'message', %s, %s, %s, %s, %s, %s)",
        (
            user_id,
            started_at,
            started_at,
            u.input_tokens,
            u.output_tokens,
            u.cache_read_tokens,
            u.cache_write_tokens,
            *(result.profile or (None, None)),
        ),
    )


def test_a_user_past_the_daily_budget_waits_for_the_next_day_told_once(server, ledger):
    """Budget 1,500 billed tokens a day (the profile's): the first run passes it; the next two
    that day make no model call and raise OverBudget until midnight UTC, and the user gets one
    notice; the next day runs call the model again."""
    # A prompt of its own: its first call writes the prompt cache (billed 1.25x), whatever ran before.
    ok(ledger, "profiles", "create", "tight", "--daily-tokens", "1500", "--system-prompt", "Spend little.")
    ok(ledger, "profiles", "assign", "team-c/*", "tight")
    day = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
    clock = ManualClock(day.timestamp())
    user = "team-c/carol"

    async def go():
        pool = db.async_pool(ledger, name="w0", max_size=2, autocommit=True)
        await pool.open(wait=True)
        agent = t.agent(server.base_url, profile_cache_s=0)
        await agent.join_fleet(pool, "worker-0")
        agent.clock = clock
        outcomes = []
        try:
            for hour in (0, 1, 2, 13):  # 12:00, 13:00, 14:00 and 01:00 the next day
                clock.set((day + timedelta(hours=hour)).timestamp())
                server.clear()
                try:
                    result = await agent.run(t.context([t.chat(f"hello at {hour}")], user_id=user))
                except OverBudget as exc:
                    outcomes.append(("waits", round(exc.retry_after or 0), len(server.requests())))
                    continue
                record_run(ledger, user, result, utc(clock.now()))
                outcomes.append(("ran", budgets.billed(result.usage), len(server.requests())))
        finally:
            await agent.close()
            await pool.close()
        return outcomes

    first, second, third, next_day = asyncio.run(go())
    assert first[0] == "ran" and first[1] > 1500 and first[2] >= 1, first
    assert second == ("waits", 11 * 3600, 0) and third == ("waits", 10 * 3600, 0)
    assert next_day[0] == "ran" and next_day[2] >= 1
    notices = query(ledger, "SELECT body FROM outbox WHERE user_id = %s", (user,))
    assert len(notices) == 1 and "daily model budget (1500 tokens) is spent" in notices[0]["body"]
    assert scalar(ledger, "SELECT profile FROM budget_notices WHERE user_id = %s", (user,)) == "tight"


def test_events_waiting_for_the_budget_count_no_attempt(ledger):
    """The worker's finish of an OverBudget run (finish_failed, waiting): the events pending
    again until the given time, the claim's attempt given back and no transient failure
    counted, unlike a model outage (transient) and a failed attempt."""
    from test_worker_claims import claim_pass, seed_pending  # the claim rules' own seeding

    seed_pending(ledger, 3)
    claims, _ = claim_pass(ledger, 3, "")
    by_user = {c.user_id: c for c in claims}

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            for user, (transient, waiting) in zip(sorted(by_user), [(False, True), (True, False), (False, False)]):
                c = by_user[user]
                await ledger_finish.finish_failed(
                    conn,
                    ids=c.event_ids,
                    epoch=c.epoch,
                    run_id=0,
                    error="budget: spent",
                    backoff_s=3600.0,
                    transient=transient,
                    waiting=waiting,
                )

    asyncio.run(go())
    rows = query(
        ledger,
        "SELECT attempts, transient_failures, status, next_attempt_at > now() + interval '59 minutes' AS later"
        " FROM events ORDER BY user_id",
    )
    assert [(r["attempts"], r["transient_failures"]) for r in rows] == [(0, 0), (0, 1), (1, 0)]
    assert all(r["status"] == "pending" and r["later"] for r in rows)


def test_the_finish_records_the_profile_version_a_run_ran_with(ledger):
    """runs.profile and runs.profile_version, as the worker's group finish writes them (the
    default profile: NULL), which the console's run page shows and resumed sessions read."""
    from test_worker_claims import claim_pass, seed_pending

    seed_pending(ledger, 2)
    claims, _ = claim_pass(ledger, 2, "")
    started = datetime.now(UTC)
    results = [RunResult(RunOutcome.NOTHING, profile=("support", 2)), RunResult(RunOutcome.NOTHING)]
    records = [run_record(Finished(c, started, result=r)) for c, r in zip(claims, results, strict=True)]

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await ledger_finish.finish_runs(conn, records, "test-worker")

    written = asyncio.run(go())
    assert len(written) == 2
    rows = query(ledger, "SELECT user_id, profile, profile_version FROM runs ORDER BY user_id")
    by_user = {r["user_id"]: (r["profile"], r["profile_version"]) for r in rows}
    assert by_user == {claims[0].user_id: ("support", 2), claims[1].user_id: (None, None)}


def test_a_conversation_is_an_invoke_agent_span_naming_its_profile_and_session(server, ledger, exporter):
    """GenAI conventions: each conversation of a run is an ``invoke_agent`` span under the run's
    (the agent: the user's profile, or ``default``; the conversation: the session), parent of
    its model and tool spans; the run's span names the profile and its version too."""
    from vigil import tracing

    server.clear()
    ok(ledger, "profiles", "create", "support", "--tools", "send_message=allow")
    ok(ledger, "profiles", "assign", "team-a/*", "support")

    async def go():
        pool = db.async_pool(ledger, name="w0", max_size=2, autocommit=True)
        await pool.open(wait=True)
        agent = t.agent(server.base_url, profile_cache_s=0)
        await agent.join_fleet(pool, "worker-0")
        try:
            results = []
            for user in ("team-a/alice", "other"):
                with tracing.span("vigil.run"):  # as the worker runs it (vigil.worker.traces)
                    results.append(await agent.run(t.context([t.chat("hello")], user_id=user)))
            return results
        finally:
            await agent.close()
            await pool.close()

    support, default = asyncio.run(go())
    spans = exporter.get_finished_spans()
    runs = [s for s in spans if s.name == "vigil.run"]
    agents = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "invoke_agent"]
    assert [s.name for s in agents] == ["invoke_agent support", "invoke_agent default"]
    for run_span, agent_span, result in zip(runs, agents, (support, default), strict=True):
        assert agent_span.parent.span_id == run_span.context.span_id
        assert agent_span.attributes["gen_ai.conversation.id"] == result.session.id
        children = [s for s in spans if s.parent is not None and s.parent.span_id == agent_span.context.span_id]
        assert {s.attributes.get("gen_ai.operation.name") for s in children} == {"chat", "execute_tool"}
    assert agents[0].attributes["gen_ai.agent.name"] == "support"
    assert agents[0].attributes["vigil.profile.version"] == 1
    assert runs[0].attributes["vigil.profile"] == "support" and runs[0].attributes["vigil.profile.version"] == 1
    assert agents[1].attributes["gen_ai.agent.name"] == "default"
    assert "vigil.profile.version" not in agents[1].attributes
    assert runs[1].attributes["vigil.profile"] == "default"
