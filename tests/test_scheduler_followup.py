"""End to end: a follow-up the agent sets in one run comes back, through the scheduler, as the
event that starts the same user's next run. Real worker, real scheduler, the real Claude
agent and SDK talking to the scripted Messages API server."""

from __future__ import annotations

import json

import pytest

from support import query, scalar, wait_for
from vigil_dev.scripted_server import ScriptedServer
from worker_support import FAST, chat, produce

SCRIPT = {
    "rules": [
        # Run 2 first: woken by the follow-up, whose note reaches the model, it resumes run 1's
        # conversation, so its events join the turn holding run 1's set_followup result.
        {
            "when": {"user_text": "oven-check-7f3"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "send_message",
                    "input": {"text": "Time to check the oven.", "urgent": False},
                }
            ],
        },
        # Run 1: the user asks for a reminder; the agent sets a follow-up a second ahead.
        {"when": {"tool_result": "set_followup"}, "reply": []},
        {
            "when": {"user_text": "(?i)remind me about the oven"},
            "reply": [
                {"type": "tool_use", "name": "set_followup", "input": {"delay_seconds": 1, "note": "oven-check-7f3"}}
            ],
        },
        {"when": {"tool_result": "send_message"}, "reply": []},
    ]
}


@pytest.fixture
def claude():
    """Requested before ``spawn``, so it stops after the worker that talks to it."""
    with ScriptedServer(SCRIPT) as server:
        yield server


def test_a_followup_set_by_a_run_fires_and_reaches_the_users_next_run(claude, stack, ledger, topics, vigil_env, spawn):
    worker_env = {
        **vigil_env,
        **FAST,
        "VIGIL_AGENT": "claude",
        "ANTHROPIC_BASE_URL": claude.base_url,
        "ANTHROPIC_API_KEY": "scripted-test-key",
        "VIGIL_MODEL": "claude-scripted-1",
    }
    spawn(["worker"], worker_env, name="worker").wait_healthy(int(vigil_env["VIGIL_WORKER_PORT"]))
    scheduler_env = {**vigil_env, "VIGIL_SCHEDULER_TICK_S": "0.2"}
    spawn(["scheduler"], scheduler_env, name="scheduler").wait_healthy(int(vigil_env["VIGIL_SCHEDULER_PORT"]))
    produce(stack.bootstrap, topics.events, [chat("carol", "Please remind me about the oven")])

    wait_for(
        lambda: scalar(ledger, "SELECT count(*) FROM outbox WHERE user_id = 'carol'") == 1,
        60,
        "the reply of the run the follow-up started",
        interval=0.2,
    )

    (timer,) = query(ledger, "SELECT id, kind, done, fired_count, due FROM timers WHERE user_id = 'carol'")
    assert (timer["kind"], timer["done"], timer["fired_count"]) == ("followup", True, 1)
    (fired,) = query(
        ledger, "SELECT id, source_id, kind, payload, status FROM events WHERE user_id = 'carol' AND source = 'timer'"
    )
    due = int(timer["due"].timestamp())
    assert (fired["source_id"], fired["kind"], fired["status"]) == (f"{timer['id']}@{due}", "timer.followup", "done")
    assert json.loads(fired["payload"])["scheduled_for"] == due
    runs = query(ledger, "SELECT event_ids, outcome, started_at FROM runs WHERE user_id = 'carol' ORDER BY id")
    assert [r["event_ids"] for r in runs][-1] == [fired["id"]]  # the follow-up started a run of its own
    assert runs[-1]["outcome"] == "message"
    sessions = query(ledger, "SELECT session_id FROM runs WHERE user_id = 'carol'")
    assert len({r["session_id"] for r in sessions}) == 1  # the follow-up resumed the conversation that set it
    assert query(ledger, "SELECT body FROM outbox WHERE user_id = 'carol'") == [{"body": "Time to check the oven."}]
    assert runs[-1]["started_at"].timestamp() >= due  # not before the time the agent asked for
