"""The Claude agent through the real services: worker, ingest and scheduler processes on the
real broker and ledger, the real SDK talking to the scripted Messages API server.

- A refund asks for approval; the person answers yes through ingest, twice: one refund,
  one resumed run. Another person never answers: the expiry resumes the session with the
  denial.
- Model API trouble: 429 twice then success is one run with a reply; 529 forever releases
  the claim again and again without the event ever counting toward the poison bound.
"""

from __future__ import annotations

import re

import httpx
import pytest

from support import query, scalar, wait_for
from vigil.worker import finish
from vigil_dev.scripted_server import ScriptedServer
from worker_support import FAST, chat, produce

# A deferred call survives only if the worker stores the session's pending call
# (vigil.agent.run_ledger.session_rows) and loads the approval rows with their argument hash
# (load_context_parts); docs/agent.md, "Worker integration". Until the worker's finish does,
# the approval test cannot pass: it is skipped, and runs by itself once the finish does.
WORKER_STORES_DEFERRED_CALLS = hasattr(finish, "session_rows")

SCRIPT = {
    "rules": [
        {
            "when": {"tool_result": "refund", "tool_result_text": r"\b(denied|expired)\b"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "No refund ({1})."}}],
        },
        {
            "when": {"tool_result": "refund"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Refund done."}}],
        },
        {"when": {"tool_result": "send_message"}, "reply": []},
        {
            "when": {"user_text": r"refund order (?P<order>\w+)"},
            "reply": [{"type": "tool_use", "name": "refund", "input": {"order_id": "{order}", "amount": 19.99}}],
        },
        {"when": {"user_text": "flaky"}, "times": 2, "error": {"status": 429, "retry_after": 0}},
        {"when": {"user_text": "overloaded"}, "error": {"status": 529, "retry_after": 0}},
        {
            "when": {"user_text": "flaky"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Made it through."}}],
        },
    ]
}


@pytest.fixture
def claude():
    """Requested before ``spawn``, so it stops after the worker that talks to it."""
    with ScriptedServer(SCRIPT) as server:
        yield server


def worker_env(vigil_env, claude, **extra):
    return {
        **vigil_env,
        **FAST,
        "VIGIL_AGENT": "claude",
        "ANTHROPIC_BASE_URL": claude.base_url,
        "ANTHROPIC_API_KEY": "scripted-test-key",
        "VIGIL_MODEL": "claude-scripted-1",
        "VIGIL_MODEL_BACKOFF_S": "0.05",
        **extra,
    }


def outbox(dsn, user):
    return [r["body"] for r in query(dsn, "SELECT body FROM outbox WHERE user_id = %s ORDER BY id", (user,))]


@pytest.mark.skipif(not WORKER_STORES_DEFERRED_CALLS, reason="the worker does not store sessions.pending yet")
def test_approval_answered_through_ingest_and_one_left_to_expire(claude, stack, ledger, topics, vigil_env, spawn):
    env = worker_env(vigil_env, claude, VIGIL_APPROVAL_DEADLINE_S="6")
    spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
    spawn(["ingest"], vigil_env, name="ingest").wait_healthy(int(vigil_env["VIGIL_INGEST_PORT"]))
    spawn(["scheduler"], {**vigil_env, "VIGIL_SCHEDULER_TICK_S": "0.2"}, name="scheduler").wait_healthy(
        int(vigil_env["VIGIL_SCHEDULER_PORT"])
    )
    produce(stack.bootstrap, topics.events, [chat("dana", "please refund order A17"), chat("erin", "refund order B2")])

    wait_for(lambda: len(outbox(ledger, "dana")) == 1, 60, "dana's approval question", interval=0.2)
    [question] = outbox(ledger, "dana")
    request_id = re.search(r"request_id: (\S+)", question).group(1)
    token = re.search(r"token: (\S+)", question).group(1)
    url = f"http://127.0.0.1:{vigil_env['VIGIL_INGEST_PORT']}/v1/approvals/{request_id}"
    for _ in range(2):  # a double tap: the second answer finds the first standing
        response = httpx.post(url, json={"answer": "yes", "token": token}, timeout=30)
        assert response.status_code == 200 and response.json()["answer"] == "yes", response.text

    wait_for(lambda: outbox(ledger, "dana")[1:] == ["Refund done."], 60, "dana's refund reply", interval=0.2)
    wait_for(lambda: outbox(ledger, "erin")[1:] == ["No refund (expired)."], 60, "erin's expiry", interval=0.2)

    refunds = query(ledger, "SELECT user_id, idempotency_key, order_id FROM refunds")
    assert refunds == [{"user_id": "dana", "idempotency_key": request_id, "order_id": "A17"}]
    runs = query(ledger, "SELECT user_id, outcome, session_id, input_tokens FROM runs ORDER BY id")
    assert sorted((r["user_id"], r["outcome"]) for r in runs) == [
        ("dana", "deferred"),
        ("dana", "message"),
        ("erin", "deferred"),
        ("erin", "message"),
    ]
    assert all(r["input_tokens"] > 0 for r in runs)
    for user in ("dana", "erin"):  # each answer resumed the session that asked
        asked, resumed = [r["session_id"] for r in runs if r["user_id"] == user]
        assert asked == resumed
        assert scalar(ledger, "SELECT state FROM sessions WHERE id = %s", (asked,)) == "open"
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source = 'approval' AND user_id = 'dana'") == 1
    assert scalar(ledger, "SELECT answer FROM approvals WHERE user_id = 'erin'") == "expired"


def test_model_overload_is_retried_and_never_kills_the_event(claude, stack, ledger, topics, vigil_env, spawn):
    env = worker_env(vigil_env, claude, VIGIL_MODEL_RETRIES="1", VIGIL_MAX_ATTEMPTS="2")
    spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
    produce(stack.bootstrap, topics.events, [chat("fay", "flaky line"), chat("gus", "overloaded")])

    wait_for(lambda: outbox(ledger, "fay") == ["Made it through."], 60, "fay's reply after two 429s", interval=0.2)
    # Each of gus's runs makes two calls (one retry) and is released; past twice the
    # poison bound of releases, the event is still pending, its attempts given back.
    wait_for(
        lambda: scalar(ledger, "SELECT transient_failures FROM events WHERE user_id = 'gus'") >= 5,
        60,
        "gus's event released five times",
        interval=0.2,
    )
    [gus] = query(ledger, "SELECT status, attempts FROM events WHERE user_id = 'gus'")
    assert gus["status"] in ("pending", "running") and gus["attempts"] <= 1
    assert query(ledger, "SELECT status FROM events WHERE user_id = 'fay'") == [{"status": "done"}]
