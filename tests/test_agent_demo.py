"""The shipped offline demonstration script (`make up` without ANTHROPIC_API_KEY), played
against the real agent: every scenario of the demo must work with the agent's real tool
names, inputs and result texts, or the demo would silently show nothing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from vigil.agent.base import ApprovalRequest, OutMessage
from vigil.ledger.approvals import args_hash
from vigil.ledger.states import RunOutcome, SessionState
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer


@pytest.fixture(scope="module")
def demo():
    with ScriptedServer() as server:  # the default script is the demo's
        yield server


def test_demo_chat_reply(demo):
    [result] = t.run(demo.base_url, t.context([t.chat("hello there")]))
    assert result.messages == [OutMessage("Hi! You said: hello there", False)]


def test_demo_reminder_set_and_delivered(demo):
    [asked] = t.run(demo.base_url, t.context([t.chat("remind me in a minute")]))
    [timer] = asked.timers
    assert asked.messages == [OutMessage("OK, I will remind you.", False)]
    assert timedelta(seconds=59) < timer.due - datetime.now(UTC) <= timedelta(seconds=61)

    # What the scheduler's event for that timer looks like when it fires.
    fired = t.event(
        "timer.followup",
        {
            "timer_id": timer.id,
            "scheduled_for": int(timer.due.timestamp()),
            "late_by": 0,
            "skipped": 0,
            "payload": timer.payload,
        },
        source="timer",
    )
    [due] = t.run(demo.base_url, t.context([fired]))
    assert due.messages == [OutMessage("Reminder: you asked me to remind you a minute ago.", True)]


def test_demo_refund_asks_and_expires_into_a_denial(demo):
    [asked] = t.run(demo.base_url, t.context([t.chat("please refund order 1234")]))
    assert asked.outcome is RunOutcome.DEFERRED and asked.session.state == SessionState.WAITING
    [approval] = asked.approvals
    assert approval.args_hash == args_hash("refund", {"order_id": "1234", "amount": 19.99})

    expired = ApprovalRequest(
        approval.request_id, approval.session_id, "refund", approval.tool_use_id, approval.args_hash, "expired"
    )
    wake = t.event(
        "approval.answer",
        {"request_id": approval.request_id, "answer": "expired"},
        source="approval",
        session_id=approval.session_id,
    )
    [resumed] = t.run(demo.base_url, t.context([wake], sessions=[t.saved(asked)], approvals=[expired]))
    assert resumed.messages == [OutMessage("The refund was not made (approval expired).", False)]


def test_demo_remembers(demo):
    memory: dict[str, str] = {}
    [result] = t.run(demo.base_url, t.context([t.chat("remember that I like green tea")], memory=memory))
    assert [(w.path, w.content) for w in result.memory_writes] == [("/memories/notes.md", "I like green tea\n")]
    assert result.messages == [OutMessage("Noted, I will remember that.", False)]


def test_demo_anything_else_is_quiet(demo):
    [result] = t.run(demo.base_url, t.context([t.event("github.push", {"ref": "main"}, source="github")]))
    assert result.outcome is RunOutcome.NOTHING and result.messages == []


def test_demo_reply_recalls_its_conversation_and_a_new_one_does_not(demo):
    [told] = t.run(demo.base_url, t.context([t.chat("my favourite colour is teal")]))
    assert told.messages == [OutMessage("Hi! You said: my favourite colour is teal", False)]
    session = told.session.id
    reply = t.chat("what did I just tell you?", session_id=session)
    [resumed] = t.run(demo.base_url, t.context([reply], sessions=[t.saved(told)]))
    assert resumed.messages == [OutMessage("You told me your favourite colour is teal.", False)]
    assert resumed.session.id == session and resumed.messages[0].session_id == session
    [fresh] = t.run(demo.base_url, t.context([t.chat("what did I just tell you?")]))
    assert fresh.messages == [OutMessage("This is a new conversation: you have not told me anything in it yet.", False)]
    assert fresh.session.id != session


def test_demo_background_research_is_delegated_and_reported(demo):
    """Step 5 of the demo: the agent delegates in the background and reports the result when
    the task's event resumes its conversation."""
    import asyncio
    import json
    import time

    from vigil.agent.base import Delegation, TaskContext

    limits = Delegation(depth=0, max_depth=2, token_budget=5000, timeout_s=60, max_attempts=3, owner_chain=("u1",))
    ctx = t.context([t.chat("please research the printing press in the background")])
    ctx.delegation = limits
    [asked] = t.run(demo.base_url, ctx)
    [task] = asked.tasks
    assert task.instructions == "Research the printing press and summarise it in one sentence."
    assert asked.messages[0].text.startswith("I have started that research in the background")

    async def execute():
        claude = t.agent(demo.base_url)
        try:
            return await claude.run_task(
                TaskContext(
                    task.id, "u1", task.instructions, task.tools, task.token_budget, time.monotonic() + 60, limits, 1
                )
            )
        finally:
            await claude.close()

    answer = asyncio.run(execute()).text
    assert answer == "the printing press in one line: it changed how knowledge spreads."
    back = t.event(
        "task.succeeded",
        {"task_id": task.id, "status": "succeeded", "result": answer, "error": None},
        source="task",
        source_id=task.id,
        session_id=asked.session.id,
    )
    [told] = t.run(demo.base_url, t.context([back], sessions=[t.saved(asked)]))
    assert told.messages == [OutMessage(f"Your background research is back: {answer}", False)]
    assert told.session.id == asked.session.id  # the delegating conversation, resumed
    assert json.dumps(told.session.messages).count("printing press") >= 2


def test_demo_order_lookup_calls_the_stacks_mcp_server(demo):
    """Step 3 of the demo: the model calls the dev stack's MCP server (started over stdio, as
    `vigil-dev up` names it) and the tool's answer reaches both the model and the user."""
    import json
    import re
    import sys
    from pathlib import Path

    import vigil_dev

    server = Path(vigil_dev.__file__).with_name("mcp_demo_server.py")
    servers = json.dumps({"shop": {"command": sys.executable, "args": [str(server)]}})
    demo.clear()
    [result] = t.run(demo.base_url, t.context([t.chat("where is order 42?")]), mcp_servers=servers)
    answer = r"order 42: shipped by (parcel post|courier|freight), tracking VG-\d{5}"
    [message] = result.messages
    assert re.fullmatch(r"The shop says \(MCP server shop\): " + answer, message.text), message.text
    # The server's answer is what the model was handed as the call's result.
    blocks = [
        block
        for turn in demo.requests()[-1]["messages"]
        if isinstance(turn["content"], list)
        for block in turn["content"]
    ]
    [call] = [b["id"] for b in blocks if b.get("type") == "tool_use" and b["name"] == "shop__order_status"]
    [content] = [b["content"] for b in blocks if b.get("type") == "tool_result" and b["tool_use_id"] == call]
    text = content if isinstance(content, str) else "".join(block["text"] for block in content)
    assert re.fullmatch(answer, text), text


def test_demo_order_question_without_the_mcp_server_is_an_echo(demo):
    """Without VIGIL_MCP_SERVERS the tool is not offered, and the rule that calls it is skipped."""
    [result] = t.run(demo.base_url, t.context([t.chat("where is order 42?")]))
    assert result.messages == [OutMessage("Hi! You said: where is order 42?", False)]
