"""Dreaming: the periodic per-user memory review, and the memory history that audits every
change (docs/agent.md, "Dreaming"). Real ledger, real scheduler and worker processes, the
real ``anthropic`` client talking to the scripted Messages API."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import psycopg
from psycopg.rows import dict_row

from support import query, scalar, wait_for
from vigil_dev.scripted_server import ScriptedServer
from worker_support import claude_env

# A process's start on a loaded two-core machine can take most of a minute (imports alone).
STARTUP_S = 120.0
MEMORY_TOOL = {"type": "memory_20250818", "name": "memory"}


def seed_sessions(ledger: str, user: str, n: int) -> None:
    with psycopg.connect(ledger, autocommit=True) as conn:
        for _ in range(n):
            conn.execute(
                "INSERT INTO sessions (id, user_id) VALUES ('ses_' || md5(random()::text), %s)",
                (user,),
            )


def reviews(ledger: str, user: str | None = None) -> list[dict]:
    return query(
        ledger,
        "SELECT * FROM tasks WHERE kind = 'memory_review' AND (%(u)s::text IS NULL OR user_id = %(u)s)"
        " ORDER BY created_at",
        {"u": user},
    )


def schedule(ledger: str, after: int) -> list:
    from vigil.ledger import dreams

    with psycopg.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
        return dreams.schedule(conn, after_sessions=after, token_budget=20_000, timeout_s=600, max_attempts=2)


def vigil(args: list[str], env: dict[str, str], expect: int = 0) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "vigil", *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == expect, (done.returncode, done.stdout, done.stderr)
    return done.stdout


def test_two_schedulers_racing_create_one_review_per_user_and_none_before_n_sessions(ledger):
    """Twenty users with 2 new sessions, two callers released together each time: every user
    gets exactly one review; a user with 1 session none; none again while one is open, and
    after it ended only once 2 more sessions came."""
    users = [f"u{i}" for i in range(20)]
    for user in users:
        seed_sessions(ledger, user, 2)
    seed_sessions(ledger, "solo", 1)
    for _ in range(3):
        gate = threading.Barrier(2)

        def go(gate: threading.Barrier = gate) -> None:
            gate.wait()
            schedule(ledger, 2)

        threads = [threading.Thread(target=go) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    rows = reviews(ledger)
    assert sorted(r["user_id"] for r in rows) == sorted(users)  # one each, "solo" none
    assert all(r["status"] == "queued" and r["tools"] == [] and r["session_id"] is None for r in rows)
    # The review ended; no new session since: nothing. One more: still nothing. Two: a second one.
    with psycopg.connect(ledger, autocommit=True) as conn:
        conn.execute("UPDATE tasks SET status = 'succeeded', finished_at = now() WHERE user_id = 'u0'")
    assert schedule(ledger, 2) == []
    seed_sessions(ledger, "u0", 1)
    assert schedule(ledger, 2) == []
    seed_sessions(ledger, "u0", 1)
    assert [r.user_id for r in schedule(ledger, 2)] == ["u0"]
    assert len(reviews(ledger, "u0")) == 2


def test_the_scheduler_creates_one_review_with_two_processes_and_none_when_off(ledger, vigil_env, spawn):
    from vigil_dev.devstack import free_port

    seed_sessions(ledger, "ann", 2)
    seed_sessions(ledger, "bob", 1)
    off = {**vigil_env, "VIGIL_DREAM_CHECK_S": "0.2"}  # VIGIL_DREAM_AFTER_SESSIONS: 0, the default
    spawn(["scheduler"], off, name="off").wait_healthy(int(off["VIGIL_SCHEDULER_PORT"]), STARTUP_S)
    time.sleep(2.0)
    assert reviews(ledger) == []
    on = {**off, "VIGIL_DREAM_AFTER_SESSIONS": "2"}
    envs = [{**on, "VIGIL_SCHEDULER_PORT": str(free_port())} for _ in range(2)]
    started = [spawn(["scheduler"], env, name=f"s{i}") for i, env in enumerate(envs)]
    for proc, env in zip(started, envs):
        proc.wait_healthy(int(env["VIGIL_SCHEDULER_PORT"]), STARTUP_S)
    wait_for(lambda: len(reviews(ledger)) > 0, 20, "a review was scheduled")
    time.sleep(2.0)  # both schedulers have checked again several times
    assert [r["user_id"] for r in reviews(ledger)] == ["ann"]


REVIEW_SCRIPT = [
    {
        "name": "done",
        "when": {"tool_result": "memory"},
        "reply": [{"type": "text", "text": "Merged bob-tz.md into people/bob.md; dropped old-deploy.md."}],
    },
    {
        "name": "review",
        "when": {"system": "memory review"},
        "reply": [
            {
                "type": "tool_use",
                "name": "memory",
                "input": {
                    "command": "str_replace",
                    "path": "/memories/people/bob.md",
                    "old_str": "Bob prefers email.",
                    "new_str": "Bob prefers email. His timezone is CET.",
                },
            },
            {"type": "tool_use", "name": "memory", "input": {"command": "delete", "path": "/memories/bob-tz.md"}},
            {"type": "tool_use", "name": "memory", "input": {"command": "delete", "path": "/memories/old-deploy.md"}},
        ],
    },
]


def memory_of(ledger: str, user: str) -> dict[str, str]:
    return {
        r["path"]: r["content"] for r in query(ledger, "SELECT path, content FROM memory WHERE user_id = %s", (user,))
    }


def test_a_review_with_memory_tools_only_merges_and_drops_audited_and_revertible(ledger, vigil_env, spawn):
    with psycopg.connect(ledger, autocommit=True) as conn:
        for path, content in {
            "/memories/people/bob.md": "# Bob\nBob prefers email.",
            "/memories/bob-tz.md": "Bob's timezone is CET.",
            "/memories/old-deploy.md": "Deploy freeze until 2025-01-03 (event evt_123).",
        }.items():
            conn.execute("INSERT INTO memory (user_id, path, content) VALUES ('ann', %s, %s)", (path, content))
    seed_sessions(ledger, "ann", 2)
    [made] = schedule(ledger, 2)
    with ScriptedServer(REVIEW_SCRIPT) as claude:
        env = claude_env(vigil_env, claude.base_url, VIGIL_TASK_HEARTBEAT_S="0.3", VIGIL_TASK_STALE_S="3")
        spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]), STARTUP_S)
        wait_for(lambda: reviews(ledger)[0]["status"] == "succeeded", 60, "the review succeeded")
        requests = claude.requests()
    assert len(requests) == 2
    for request in requests:
        assert request["tools"] == [MEMORY_TOOL]  # memory only: no send_message, no action tools
        assert "memory review" in json.dumps(request["system"])
    assert memory_of(ledger, "ann") == {"/memories/people/bob.md": "# Bob\nBob prefers email. His timezone is CET."}
    # Its result wakes nobody: no event, so no conversation is started by a review.
    wait_for(lambda: reviews(ledger)[0]["reported_at"] is not None, 20, "the review marked reported")
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source = 'task'") == 0

    history = [json.loads(line) for line in vigil(["memory", "history", "ann", "--json"], vigil_env).splitlines()]
    assert [(h["path"], h["task_id"], h["run_id"]) for h in history] == [
        ("/memories/old-deploy.md", made.id, None),
        ("/memories/bob-tz.md", made.id, None),
        ("/memories/people/bob.md", made.id, None),
    ]  # newest first
    dropped = history[0]
    assert (dropped["old_content"], dropped["new_content"]) == ("Deploy freeze until 2025-01-03 (event evt_123).", None)
    assert history[2]["old_content"] == "# Bob\nBob prefers email."
    text = vigil(["memory", "history", "ann"], vigil_env)
    assert "/memories/old-deploy.md" in text and "deleted" in text

    out = vigil(["memory", "revert", str(dropped["id"]), "--actor", "oncall"], vigil_env)
    assert "restored" in out
    assert memory_of(ledger, "ann")["/memories/old-deploy.md"] == "Deploy freeze until 2025-01-03 (event evt_123)."
    latest = json.loads(vigil(["memory", "history", "ann", "--json"], vigil_env).splitlines()[0])
    assert (latest["reverts"], latest["actor"], latest["old_content"]) == (dropped["id"], "oncall", None)
    assert latest["new_content"] == dropped["old_content"]
    # The change no longer describes what is stored: a second revert is refused, nothing written.
    vigil(["memory", "revert", str(dropped["id"])], vigil_env, expect=4)
    vigil(["memory", "revert", "999999"], vigil_env, expect=1)
    assert scalar(ledger, "SELECT count(*) FROM memory_history WHERE user_id = 'ann'") == 4


def test_a_runs_memory_writes_are_audited_with_the_run(ledger):
    """Every write through the finish's one statement leaves a row; an unchanged write none."""
    from vigil.ledger import finish as ledger_finish

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            for content in ("one", "two", "two", None):
                await ledger_finish.write_memory(conn, user_id="cy", path="/memories/a.md", content=content, run_id=7)
            await ledger_finish.write_memory(conn, user_id="cy", path="/memories/none.md", content=None, run_id=7)

    asyncio.run(go())
    rows = query(ledger, "SELECT old_content, new_content, run_id, task_id FROM memory_history ORDER BY id")
    assert [(r["old_content"], r["new_content"]) for r in rows] == [(None, "one"), ("one", "two"), ("two", None)]
    assert {(r["run_id"], r["task_id"]) for r in rows} == {(7, None)}


def test_a_review_never_touches_the_persons_instructions():
    """In process, through the real client, with refund allowed on this worker: the review is
    offered memory only; the instructions file is not shown to it and it cannot delete it."""
    from vigil.agent.base import Delegation, TaskContext
    from vigil.ledger.dreams import REVIEW
    from vigil_dev import agent_testing as t

    script = [
        {"when": {"tool_result": "memory"}, "reply": [{"type": "text", "text": "done"}]},
        {
            "reply": [
                {"type": "tool_use", "name": "memory", "input": {"command": "view", "path": "/memories"}},
                {
                    "type": "tool_use",
                    "name": "memory",
                    "input": {"command": "delete", "path": "/memories/instructions.md"},
                },
                {"type": "tool_use", "name": "memory", "input": {"command": "delete", "path": "/memories/a.md"}},
            ]
        },
    ]
    files = {"/memories/instructions.md": "Be brief.", "/memories/a.md": "old"}
    ctx = TaskContext(
        task_id="tsk_r",
        user_id="u1",
        instructions="Review this person's memory.",
        tools=(),
        token_budget=5000,
        deadline=time.monotonic() + 60,
        delegation=Delegation(
            depth=1, max_depth=2, token_budget=5000, timeout_s=60, max_attempts=3, owner_chain=("u1",)
        ),
        attempt=1,
        kind=REVIEW,
        memory=files,
    )

    async def go():
        claude = t.agent(server.base_url, tool_permissions="refund=allow")
        try:
            return await claude.run_task(ctx)
        finally:
            await claude.close()

    with ScriptedServer(script) as server:
        result = asyncio.run(go())
        first, second = server.requests()
    assert first["tools"] == [MEMORY_TOOL]
    assert "instructions.md" not in json.dumps(first["messages"]) and "Be brief" not in json.dumps(first)
    assert second["tools"] == [MEMORY_TOOL]
    listing = json.dumps(second["messages"][-1]["content"][0])
    assert "/memories/a.md" in listing and "instructions.md" not in listing
    assert [(w.path, w.content) for w in result.memory_writes] == [("/memories/a.md", None)]
    assert files == {"/memories/instructions.md": "Be brief.", "/memories/a.md": "old"}  # the caller's copy
