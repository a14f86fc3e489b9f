"""Deferred tool calls end to end through the agent: asking, the answer (yes, no, expiry,
twice), arguments that changed, escalation, and several sessions resumed in one run. The
refund tool records into the test's real ledger, which is where "ran once" is checked."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from otlp_support import UNSET
from support import query, scalar
from vigil.agent.base import ApprovalRequest, OutMessage
from vigil.ledger.approvals import args_hash, sign_token
from vigil.ledger.states import OnExpiry, RunOutcome, SessionState
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

REFUND_INPUT = {"order_id": "A17", "amount": 19.99}
# Refund outcomes first: a resumed turn also carries the result of the send_message made
# beside the refund call.
SCRIPT = [
    {
        "when": {"tool_result": "refund", "tool_result_text": r"\b(denied|expired)\b"},
        "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "No refund ({1})."}}],
    },
    {
        "when": {"tool_result": "refund", "tool_result_error": True},
        "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "The refund failed."}}],
    },
    {
        "when": {"tool_result": "refund"},
        "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Refund done."}}],
    },
    {
        "when": {"user_text": "refund order A17"},
        "reply": [
            {"type": "text", "text": "The customer was charged twice."},
            {"type": "tool_use", "name": "send_message", "input": {"text": "Asking you about the refund."}},
            {"type": "tool_use", "name": "refund", "input": REFUND_INPUT},
        ],
    },
    {"when": {"tool_result": "send_message"}, "reply": []},
    {"reply": []},
]


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(SCRIPT) as s:
        yield s


@pytest.fixture
def agent_run(server, ledger):
    server.clear()

    def go(*ctxs, **overrides):
        return t.run(server.base_url, *ctxs, database_url=ledger, **overrides)

    return go


def refunds(dsn):
    return query(dsn, "SELECT idempotency_key, order_id, amount FROM refunds ORDER BY id")


def answer(asked, given: str, *, args=REFUND_INPUT, source_id=None):
    """The approval row as the ledger holds it after the answer, and the wake-up event."""
    [approval] = asked.approvals
    row = ApprovalRequest(
        approval.request_id, approval.session_id, "refund", approval.tool_use_id, args_hash("refund", args), given
    )
    wake = t.event(
        "approval.answer",
        {"request_id": approval.request_id, "answer": given, "tool": "refund"},
        source="approval",
        session_id=approval.session_id,
        source_id=source_id or approval.request_id,
    )
    return row, wake


@pytest.fixture
def asked(agent_run):
    [result] = agent_run(t.context([t.chat("please refund order A17")]))
    return result


def test_a_call_needing_approval_ends_the_run_and_asks(asked, ledger, server):
    assert asked.outcome is RunOutcome.DEFERRED
    [approval] = asked.approvals
    assert approval.tool == "refund" and approval.args_hash == args_hash("refund", REFUND_INPUT)
    assert approval.on_expiry is OnExpiry.DENY and approval.due.microsecond == 0
    assert timedelta(seconds=3590) < approval.due - datetime.now(UTC) <= timedelta(seconds=3601)
    [timer] = asked.timers
    assert (timer.kind, timer.fixed_key, timer.payload, timer.due) == (
        "approval_expiry",
        approval.request_id,
        {"request_id": approval.request_id},
        approval.due,
    )
    # The send_message made beside the deferred call went out; the question is urgent and signed.
    chat_reply, question = asked.messages
    assert chat_reply == OutMessage("Asking you about the refund.", False)
    assert question.urgent and "refund 19.99 for order A17" in question.text
    assert "Why: The customer was charged twice." in question.text
    assert f"request_id: {approval.request_id}" in question.text
    assert f"token: {sign_token(secret=t.TEST_SECRET, request_id=approval.request_id, user_id='u1')}" in question.text
    session = asked.session
    assert session.state == SessionState.WAITING and session.id == approval.session_id
    assert session.messages[-1]["role"] == "assistant"  # saved mid-call
    assert session.pending["request_id"] == approval.request_id and session.pending["input"] == REFUND_INPUT
    assert refunds(ledger) == []
    assert len(server.requests()) == 1  # the run ended at the call


def test_approved_runs_the_tool_once_even_when_the_answer_comes_twice(asked, agent_run, ledger, server):
    waiting = t.saved(asked)
    row, wake = answer(asked, "yes")
    resume = t.context([wake], sessions=[waiting], approvals=[row])
    # The same claim run twice (a crash after the tool ran, before the finish committed),
    # then a second copy of the answer reaching the session the first one reopened.
    first, retried = agent_run(resume, replace(resume, events=list(resume.events)))
    again = t.context([answer(asked, "yes", source_id="copy")[1]], sessions=[t.saved(first)], approvals=[row])
    [duplicate] = agent_run(again)

    assert first.messages == [OutMessage("Refund done.", False)] and first.outcome is RunOutcome.MESSAGE
    assert first.session.state == SessionState.OPEN and first.session.pending is None
    [made] = refunds(ledger)
    assert made["idempotency_key"] == row.request_id and made["order_id"] == "A17"
    assert "already made" in json.dumps(retried.session.messages)  # the retry found the first refund
    assert duplicate.outcome is RunOutcome.NOTHING and duplicate.session is None
    assert len(refunds(ledger)) == 1
    # The resumed turn answers both calls of the saved turn, in order, so the API accepts it.
    results = first.session.messages[2]["content"]
    assert [r["tool_use_id"] for r in results] == [
        b["id"] for b in asked.session.messages[-1]["content"] if b["type"] == "tool_use"
    ]


@pytest.mark.parametrize("given, word", [("no", "denied"), ("expired", "expired")])
def test_denied_or_expired_resumes_with_the_refusal(asked, agent_run, ledger, given, word):
    row, wake = answer(asked, given)
    [result] = agent_run(t.context([wake], sessions=[t.saved(asked)], approvals=[row]))

    assert result.messages == [OutMessage(f"No refund ({word}).", False)]
    assert result.session.state == SessionState.OPEN
    assert refunds(ledger) == []


def test_arguments_changed_since_the_approval_are_refused(asked, agent_run, ledger):
    # The person approved 19.99; the approval row holds that hash. Whatever is about to run
    # (here: a saved session altered to 1999) must hash the same, or nothing runs.
    waiting = t.saved(asked)
    tampered = replace(waiting, pending={**waiting.pending, "input": {"order_id": "A17", "amount": 1999}})
    row, wake = answer(asked, "yes")
    [result] = agent_run(t.context([wake], sessions=[tampered], approvals=[row]))

    assert result.messages == [OutMessage("The refund failed.", False)]
    assert "differ from the ones the person approved" in json.dumps(result.session.messages)
    assert refunds(ledger) == []


def test_an_approval_for_a_tool_denied_since_is_refused(asked, agent_run, ledger):
    row, wake = answer(asked, "yes")
    [result] = agent_run(t.context([wake], sessions=[t.saved(asked)], approvals=[row]), tool_permissions="refund=deny")
    assert "no longer permitted" in json.dumps(result.session.messages)
    assert refunds(ledger) == []


def test_an_unverifiable_answer_counts_as_denied(asked, agent_run, ledger):
    _, wake = answer(asked, "yes")  # the event says yes, but no approval row backs it
    [result] = agent_run(t.context([wake], sessions=[t.saved(asked)]))
    assert result.messages == [OutMessage("No refund (denied).", False)]
    assert refunds(ledger) == []


def test_escalation_asks_again_louder_and_keeps_waiting(asked, agent_run, server):
    [approval] = asked.approvals
    later = (approval.due + timedelta(hours=1)).isoformat()
    escalation = t.event(
        "approval.escalate",
        {"request_id": approval.request_id, "due": later},
        source="approval",
        session_id=approval.session_id,
        source_id=f"{approval.request_id}/escalation",
    )
    server.clear()
    [result] = agent_run(t.context([escalation], sessions=[t.saved(asked)]))

    [again] = result.messages
    assert again.urgent and again.text.startswith("STILL WAITING FOR YOUR ANSWER: refund 19.99")
    assert (
        later in again.text
        and sign_token(secret=t.TEST_SECRET, request_id=approval.request_id, user_id="u1") in again.text
    )
    assert result.session.state == SessionState.WAITING and result.session.pending["due"] == later
    assert result.approvals == [] and server.requests() == []  # no model call needed


def test_a_message_to_a_waiting_session_starts_a_new_one(asked, agent_run):
    # An unclear reply; a clear yes or no is an answer at ingest (test_ingest_approvals.py).
    waiting = t.saved(asked)
    [result] = agent_run(t.context([t.chat("hello?", session_id=waiting.id)], sessions=[waiting]))
    assert result.session.id != waiting.id and result.other_sessions == []


def test_a_task_result_for_a_waiting_session_is_delivered_to_it_when_it_resumes(asked, agent_run, server):
    """Before: the result of work the conversation delegated, arriving while it waited on the
    person, went to a fresh session that knew nothing of it."""
    waiting = t.saved(asked)
    result_payload = {"task_id": "task-9", "status": "succeeded", "result": "order A17 was charged twice on 3 May"}
    done = t.event("task.succeeded", result_payload, source="task", session_id=waiting.id, source_id="task-9")
    server.clear()
    [held] = agent_run(t.context([done], sessions=[waiting]))
    assert server.requests() == [] and held.messages == []  # no new conversation, nothing said yet
    assert held.session.id == waiting.id and held.session.state == SessionState.WAITING
    assert [e["source_id"] for e in held.session.pending["held"]] == ["task-9"]
    row, wake = answer(asked, "yes")
    [resumed] = agent_run(t.context([wake], sessions=[t.saved(held)], approvals=[row]))
    request = server.requests()[0]
    assert "order A17 was charged twice on 3 May" in json.dumps(request["messages"])  # in the resumed transcript
    assert resumed.session.id == waiting.id and resumed.session.state == SessionState.OPEN
    assert resumed.session.pending is None


def test_two_sessions_answered_in_one_claim_both_resume(agent_run, ledger):
    one, two = agent_run(t.context([t.chat("refund order A17")]), t.context([t.chat("refund order A17")]))
    (row1, wake1), (row2, wake2) = answer(one, "yes"), answer(two, "no")
    [both] = agent_run(
        t.context([wake1, wake2, t.chat("thanks")], sessions=[t.saved(one), t.saved(two)], approvals=[row1, row2])
    )

    saved = {s.id: s for s in [both.session, *both.other_sessions]}
    assert set(saved) == {one.session.id, two.session.id}
    assert all(s.state == SessionState.OPEN for s in saved.values())
    assert both.messages == [OutMessage("Refund done.", False), OutMessage("No refund (denied).", False)]
    assert scalar(ledger, "SELECT count(*) FROM refunds") == 1
    # The loose chat message joined the first resumed conversation rather than opening a third.
    assert "thanks" in json.dumps(saved[one.session.id].messages)
    assert "thanks" not in json.dumps(saved[two.session.id].messages)


def test_the_answer_token_never_reaches_the_model(asked, agent_run, server):
    # The question, once delivered, is one of the "already said" messages of the next run.
    token = sign_token(secret=t.TEST_SECRET, request_id=asked.approvals[0].request_id, user_id="u1")
    server.clear()
    agent_run(t.context([t.chat("any news?")], recent=[m.text for m in asked.messages]))
    sent = json.dumps(server.requests())
    assert "Approval needed: refund 19.99" in sent and token not in sent


def test_a_resumed_call_has_its_tool_span_with_the_decision(asked, agent_run, exporter):
    """The approved call runs in an execute_tool span of its own (it used to run outside any),
    and a denied one says so."""
    from opentelemetry.trace import StatusCode

    waiting = t.saved(asked)
    for given, decision in (("yes", "approved"), ("no", "declined")):
        exporter.clear()
        row, wake = answer(asked, given)
        agent_run(t.context([wake], sessions=[waiting], approvals=[row]))
        [span] = [s for s in exporter.get_finished_spans() if s.name == "execute_tool refund"]
        assert span.attributes["vigil.tool.decision"] == decision
        assert span.attributes["vigil.approval.request_id"] == row.request_id
        assert span.attributes["gen_ai.tool.call.id"] == row.tool_use_id
        if decision == "approved":
            assert span.status.status_code is StatusCode.UNSET
        else:
            assert span.status.status_code is StatusCode.ERROR and span.attributes["error.type"] == "declined"


def test_an_approved_call_reads_correctly_in_an_otlp_receiver(otlp, asked, agent_run):
    """What a tracing backend is sent over OTLP: the asking run's span says ask, and the run the
    answer woke has the call's own span, approved, naming the request."""
    row, wake = answer(asked, "yes")
    agent_run(t.context([wake], sessions=[t.saved(asked)], approvals=[row]))
    otlp.flush()
    deferred, approved = otlp.named("execute_tool refund")
    assert deferred.attributes["vigil.tool.decision"] == "ask"
    assert approved.attributes["vigil.tool.decision"] == "approved"
    assert approved.attributes["vigil.approval.request_id"] == row.request_id and approved.status == UNSET
    [woken] = [s for s in otlp.trace(approved.trace_id) if s.span_id == approved.parent]
    assert woken.name == "invoke_agent default" and approved.trace_id != deferred.trace_id
