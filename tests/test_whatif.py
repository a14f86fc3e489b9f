"""What-if replay and the canary (`vigil runs replay`; docs/agent.md, "Changing an agent safely").

A worker keeps its runs' journals (VIGIL_RUN_JOURNAL_DAYS=1): a chat "refund A<n>" makes the
scripted model POST a refund to a receiver on 127.0.0.1, then send a message. The replay runs
in the CLI's process against the same scripted server; a prompt that says "Cancel instead"
makes the model POST to /cancellations: a call the recorded run did not make, shown and never
executed (the receiver sees nothing), and nothing lands in the ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import query, scalar, wait_for
from test_durable_runs import Receiver
from vigil_dev.scripted_server import ScriptedServer
from worker_support import chat, claude_env, produce

CANCEL = "Cancel instead of refunding"
TOOLS = "http_request=allow,send_message=allow"


def script(url: str) -> dict:
    """The recorded behaviour, and under a prompt saying CANCEL, a cancellation for orders whose
    number ends in 0-4 (the others are refunded as before)."""

    def post(path: str) -> list[dict]:
        body = '{{"order": "{order}"}}'
        return [
            {
                "type": "tool_use",
                "name": "http_request",
                "input": {"method": "POST", "url": f"{url}/{path}", "body": body},
            }
        ]

    return {
        "rules": [
            {"when": {"tool_result": "send_message"}, "reply": []},
            {
                "when": {"tool_result": "http_request"},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Done."}}],
            },
            {
                "when": {"system": CANCEL, "user_text": "refund (?P<order>A\\d*[0-4])\\b"},
                "reply": post("cancellations"),
            },
            {"when": {"user_text": "refund (?P<order>A\\d+)"}, "reply": post("refunds")},
        ]
    }


def vigil(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "vigil", *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def kept_runs(stack, topics, ledger, vigil_env, spawn, server, receiver, users: list[str]) -> dict[str, str]:
    """One finished, kept run per user (profile refunds v1); their keys by user."""
    env = cli_env(vigil_env, ledger, server, receiver)
    vigil(env, "profiles", "create", "refunds", "--tools", TOOLS)
    vigil(env, "profiles", "assign", "*", "refunds")
    worker_env = {**env, "VIGIL_INSTANCE_ID": "worker-a", "VIGIL_RUN_JOURNAL_DAYS": "1"}
    proc = spawn(["worker"], worker_env, "worker-a")
    proc.wait_healthy(int(worker_env["VIGIL_WORKER_PORT"]))
    produce(stack.bootstrap, topics.events, [chat(u, f"refund A{n}") for n, u in enumerate(users)])
    wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox") == len(users), 120, "every run to finish")
    wait_for(lambda: scalar(ledger, "SELECT count(*) FROM run_journal WHERE finished_at IS NULL") == 0, 30)
    proc.stop()
    assert len(receiver.keys) == len(users)
    rows = query(ledger, "SELECT user_id, min(id) AS first FROM events GROUP BY user_id")
    return {r["user_id"]: f"{r['user_id']}:{r['first']}" for r in rows}


def cli_env(vigil_env, ledger, server, receiver) -> dict[str, str]:
    return claude_env(
        {**os.environ, **vigil_env, "VIGIL_DATABASE_URL": ledger},
        server.base_url,
        VIGIL_TOOL_PERMISSIONS="http_request=allow",
        VIGIL_HTTP_ALLOWED_HOSTS=receiver.url.removeprefix("http://"),
    )


def ledger_state(ledger: str) -> dict:
    return {
        table: scalar(ledger, f"SELECT count(*) FROM {table}")
        for table in ("outbox", "run_journal", "runs", "memory", "timers", "approvals", "tasks")
    } | {"pending": scalar(ledger, "SELECT count(*) FROM events WHERE status <> 'done'")}


def test_a_replay_against_a_prompt_that_calls_another_tool_shows_it_and_executes_nothing(
    stack, topics, ledger, vigil_env, spawn, tmp_path
):
    receiver = Receiver()
    with ScriptedServer(script(receiver.url)) as server:
        keys = kept_runs(stack, topics, ledger, vigil_env, spawn, server, receiver, ["ann"])
        env = cli_env(vigil_env, ledger, server, receiver)
        before, posts = ledger_state(ledger), list(receiver.calls)

        same = json.loads(vigil(env, "runs", "replay", keys["ann"], "--json").stdout)
        prompt = tmp_path / "prompt.md"
        prompt.write_text(f"{CANCEL}: customers asking for a refund get their order cancelled.")
        changed = json.loads(
            vigil(env, "runs", "replay", keys["ann"], "--system-prompt-file", str(prompt), "--json").stdout
        )
        text = vigil(env, "runs", "replay", keys["ann"], "--system-prompt-file", str(prompt)).stdout
    receiver.close()

    assert same["verdict"] == "same actions", same
    assert [c["became"] for c in same["replay"]["turns"][0]["calls"]] == ["served"]
    assert changed["verdict"] == "new actions", changed
    recorded_call = changed["recorded"]["turns"][0]["calls"][0]
    replay_call = changed["replay"]["turns"][0]["calls"][0]
    assert recorded_call["input"]["url"].endswith("/refunds")
    assert (replay_call["tool"], replay_call["became"]) == ("http_request", "new")
    assert replay_call["input"]["url"].endswith("/cancellations")
    assert changed["replay"]["messages"] == ["Done."]
    assert "not executed" in text and "/cancellations" in text, text
    # Nothing executed, nothing sent, nothing written.
    assert receiver.calls == posts, receiver.calls
    assert ledger_state(ledger) == before
    # Each replay is recorded for the console's run page: and only that.
    recorded = query(ledger, "SELECT run_key, verdict FROM run_replays ORDER BY id")
    assert [(r["run_key"], r["verdict"]) for r in recorded] == [
        (keys["ann"], "same actions"),
        (keys["ann"], "new actions"),
        (keys["ann"], "new actions"),
    ]


def test_the_canary_over_50_kept_runs_prints_its_table(stack, topics, ledger, vigil_env, spawn):
    receiver = Receiver()
    users = [f"u{n:02d}" for n in range(50)]
    with ScriptedServer(script(receiver.url)) as server:
        kept_runs(stack, topics, ledger, vigil_env, spawn, server, receiver, users)
        env = cli_env(vigil_env, ledger, server, receiver)
        vigil(env, "profiles", "update", "refunds", "--system-prompt", f"{CANCEL}.")  # version 2
        before, posts = ledger_state(ledger), list(receiver.calls)
        argv = ["runs", "replay", "--sample", "50", "--since", "1d", "--profile", "refunds", "--against-version", "2"]
        table = vigil(env, *argv).stdout
        report = json.loads(vigil(env, *argv, "--json").stdout)
    receiver.close()

    print(table)
    assert report["runs"] == 50
    # Orders A0-A49: those ending in 0-4 are cancelled under version 2, the others refunded as before.
    assert (report["same_actions"], report["different_actions"], report["new_actions"]) == (25, 0, 25), report
    assert report["messages_changed"] == 0
    assert report["tokens"]["before"] > 0 and report["tokens"]["after"] > 0
    assert all(r["diff"].startswith(f"vigil runs replay {r['run_key']}") for r in report["runs_differing"])
    assert "same actions" in table and "new actions" in table and "tokens before/after" in table, table
    assert receiver.calls == posts
    assert ledger_state(ledger) == before


def test_a_canary_against_a_draft_profile_compares_the_runs_of_the_assigned_one(
    stack, topics, ledger, vigil_env, spawn
):
    """The loop of docs/agent.md: a draft (a profile assigned to nobody) is tried on the kept
    runs of the assigned profile before it ships."""
    receiver = Receiver()
    with ScriptedServer(script(receiver.url)) as server:
        keys = kept_runs(stack, topics, ledger, vigil_env, spawn, server, receiver, [f"u{n}" for n in range(6)])
        env = cli_env(vigil_env, ledger, server, receiver)
        vigil(env, "profiles", "create", "refunds-next", "--system-prompt", f"{CANCEL}.", "--tools", TOOLS)
        before, posts = ledger_state(ledger), list(receiver.calls)
        argv = ["runs", "replay", "--sample", "10", "--since", "1d", "--profile", "refunds"]
        report = json.loads(vigil(env, *argv, "--against-profile", "refunds-next", "--json").stdout)
    receiver.close()

    # Orders A0-A4 are cancelled under the draft (a new call, not executed); A5 refunded as before.
    assert (report["runs"], report["same_actions"], report["new_actions"]) == (6, 1, 5), report
    differing = {r["run_key"]: r["diff"] for r in report["runs_differing"]}
    assert differing == {keys[f"u{n}"]: f"vigil runs replay {keys[f'u{n}']} --profile refunds-next" for n in range(5)}
    assert receiver.calls == posts
    assert ledger_state(ledger) == before
