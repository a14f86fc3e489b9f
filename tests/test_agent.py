"""The Claude agent's run, driven through the real anthropic SDK against the scripted server:
the three endings, follow-ups, budgets, API failures, the cached prefix, events mid-run."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import anthropic
import pytest

from vigil.agent.base import OutMessage, RetryLater
from vigil.ledger.states import RunOutcome, SessionState
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

END_AFTER_SEND = {"when": {"tool_result": "send_message"}, "reply": []}


@pytest.fixture(scope="module")
def server():
    # One server for the module: starting uvicorn per test would dominate the run time.
    with ScriptedServer([]) as s:
        yield s


@pytest.fixture
def serve(server):
    def use(rules, **script):
        server.set_script({"rules": rules, **script})
        server.clear()
        return server

    return use


def run(server, *ctxs, **overrides):
    return t.run(server.base_url, *ctxs, **overrides)


def say(pattern, text, urgent=False):
    return {
        "when": {"user_text": pattern},
        "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": text, "urgent": urgent}}],
    }


def test_a_chat_message_gets_a_reply(serve):
    server = serve([END_AFTER_SEND, say(r"hello (?P<who>\w+)", "Hi {who}!")])
    [result] = run(server, t.context([t.chat("hello Ada")]))

    assert result.outcome is RunOutcome.MESSAGE
    assert result.messages == [OutMessage("Hi Ada!", False)]
    assert result.usage.turns == 2 and result.usage.input_tokens > 0 and result.usage.output_tokens > 0
    assert result.usage.tool_calls == 1  # send_message, recorded as runs.tool_calls
    assert result.session.state == SessionState.OPEN and result.session.id.startswith("ses-")
    first, second = server.requests()
    assert first["model"] == t.SCRIPTED_MODEL
    assert [tool["name"] for tool in first["tools"]] == [
        "send_message",
        "set_followup",
        "memory",
        "delegate",
        "tasks_list",
        "task_result",
        "task_cancel",
        "refund",
    ]
    assert '"kind": "chat.message"' in first["messages"][0]["content"][0]["text"]
    # The session keeps the transcript the model saw (the empty last answer is not stored),
    # without the cache marker the request carried on its last block.
    assert [m["role"] for m in result.session.messages] == ["user", "assistant", "user"]
    assert "cache_control" not in json.dumps(result.session.messages)
    sent = json.loads(json.dumps(second["messages"]))
    assert sent[-1]["content"][-1].pop("cache_control") == {"type": "ephemeral"}
    assert sent == result.session.messages


def test_nothing_worth_saying_ends_quietly(serve):
    server = serve([{"reply": [{"type": "text", "text": "Nothing for me to do here."}]}])
    [result] = run(server, t.context([t.event("github.push", {"ref": "refs/heads/main"}, source="github")]))

    assert result.outcome is RunOutcome.NOTHING
    assert result.messages == [] and result.timers == [] and result.approvals == []
    assert result.usage.turns == 1 and result.usage.tool_calls == 0
    assert len(server.requests()) == 1


def test_a_follow_up_is_returned_as_a_timer(serve):
    server = serve(
        [
            {"when": {"tool_result": "set_followup"}, "reply": []},
            {
                "when": {"user_text": r"remind me in (?P<n>\d+) seconds"},
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "set_followup",
                        "input": {"delay_seconds": "{n:int}", "note": "stretch your legs"},
                    }
                ],
            },
        ]
    )
    before = datetime.now(UTC)
    [result] = run(server, t.context([t.chat("remind me in 90 seconds")]))

    assert result.outcome is RunOutcome.NOTHING  # a timer is not a message
    [timer] = result.timers
    # The payload names the conversation that set it: the follow-up resumes it.
    assert timer.kind == "followup" and timer.payload == {"note": "stretch your legs", "session_id": result.session.id}
    assert timer.due.microsecond == 0
    assert before + timedelta(seconds=90) <= timer.due <= datetime.now(UTC) + timedelta(seconds=91)
    assert "set for" in server.requests()[-1]["messages"][-1]["content"][0]["content"]


def test_a_follow_up_in_the_past_is_refused_to_the_model(serve):
    server = serve(
        [
            {"when": {"tool_result": "set_followup"}, "reply": []},
            {
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "set_followup",
                        "input": {"at": "2001-01-01T00:00:00+00:00", "note": "too late"},
                    }
                ]
            },
        ]
    )
    [result] = run(server, t.context([t.chat("whenever")]))
    assert result.timers == []
    refusal = server.requests()[-1]["messages"][-1]["content"][0]
    assert refusal["is_error"] is True and "already past" in refusal["content"]


def test_rate_limited_twice_then_the_run_succeeds(serve):
    server = serve([{"times": 2, "error": {"status": 429, "retry_after": 0}}, END_AFTER_SEND, say("hello", "Hello!")])
    [result] = run(server, t.context([t.chat("hello")]))
    assert result.messages == [OutMessage("Hello!", False)]
    assert len(server.requests()) == 4  # two refused, then the reply and its end


def test_overloaded_forever_asks_the_worker_to_retry_later(serve):
    server = serve([{"error": {"status": 529, "retry_after": 0}}])
    with pytest.raises(RetryLater) as raised:
        run(server, t.context([t.chat("hello")]), model_retries=2)
    assert "overloaded" in raised.value.reason
    assert len(server.requests()) == 3


def test_a_bad_request_is_a_failed_attempt_not_a_retry(serve):
    server = serve([{"error": {"status": 400, "message": "prompt is too long"}}])
    with pytest.raises(anthropic.BadRequestError):
        run(server, t.context([t.chat("hello")]))
    assert len(server.requests()) == 1


def test_the_cached_prefix_is_identical_across_runs_and_marked(serve):
    server = serve([END_AFTER_SEND, say("(?s).", "ok")])
    memory = {
        "/memories/instructions.md": "Call me Ada.\n",
        "/memories/people/bob.md": "# Bob, my brother\nLikes chess",
    }
    first, second = run(
        server,
        t.context([t.chat("one")], memory=dict(memory)),
        t.context([t.chat("two")], memory=dict(memory), recent=["ok"]),
    )
    opening = [r for r in server.requests() if len(r["messages"]) == 1]
    assert len(opening) == 2
    a, b = opening
    assert json.dumps(a["tools"]) == json.dumps(b["tools"])
    assert json.dumps(a["system"][:2]) == json.dumps(b["system"][:2])
    assert [blk.get("cache_control") for blk in a["system"]] == [{"type": "ephemeral"}, {"type": "ephemeral"}, None]
    assert (
        "Call me Ada." in a["system"][1]["text"]
        and "/memories/people/bob.md -- Bob, my brother" in a["system"][1]["text"]
    )
    assert "Likes chess" not in a["system"][1]["text"]  # only the index: details are fetched on demand
    assert '"ok"' in b["system"][2]["text"]  # what was already said: after the cached part
    assert first.usage.cache_write_tokens > 0
    assert second.usage.cache_read_tokens >= first.usage.cache_write_tokens > 0


def test_instructions_are_loaded_on_every_run(serve):
    server = serve(
        [
            {"when": {"tool_result": "memory"}, "reply": []},
            {
                "when": {"user_text": "call me (?P<name>\\w+)"},
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "memory",
                        "input": {
                            "command": "str_replace",
                            "path": "/memories/instructions.md",
                            "old_str": "Answer briefly.",
                            "new_str": "Answer briefly. Call me {name}.",
                        },
                    }
                ],
            },
            {"reply": []},
        ]
    )
    memory = {"/memories/instructions.md": "Answer briefly."}
    first, second = run(
        server,
        t.context([t.chat("from now on call me Ada")], memory=memory),
        t.context([t.event("timer.followup", {"payload": {"note": "check"}}, source="timer")], memory=memory),
    )
    assert [(w.path, w.content) for w in first.memory_writes] == [
        ("/memories/instructions.md", "Answer briefly. Call me Ada.")
    ]
    systems = [r["system"][1]["text"] for r in server.requests()]
    assert "Answer briefly." in systems[0] and "Call me Ada" not in systems[0]
    assert "Answer briefly. Call me Ada." in systems[-1]  # the next run reads the edited file


def test_a_run_stops_at_its_turn_budget_and_the_session_resumes(serve):
    looping = {"reply": [{"type": "tool_use", "name": "memory", "input": {"command": "view", "path": "/memories"}}]}
    server = serve([say("answer now", "done"), END_AFTER_SEND, looping])
    [stopped] = run(server, t.context([t.chat("think forever")]), max_turns=2)
    assert stopped.usage.turns == 2 and stopped.outcome is RunOutcome.NOTHING
    assert stopped.session.messages[-1]["role"] == "user"  # tool results the model has not seen yet

    session = t.saved(stopped)
    [resumed] = run(server, t.context([t.chat("answer now", session_id=session.id)], sessions=[session]))
    assert resumed.messages == [OutMessage("done", False)]
    assert resumed.session.id == session.id
    # The pending tool results and the new message went out as one user turn: the API accepts it.
    assert resumed.usage.turns == 2


def test_a_session_past_its_size_budget_is_closed_and_the_next_starts_fresh(serve):
    server = serve([END_AFTER_SEND, say("(?s).", "x" * 3000)])
    [big] = run(server, t.context([t.chat("write a lot")]), session_max_bytes=2000)
    assert big.session.state == SessionState.CLOSED

    closed = t.saved(big)
    [fresh] = run(server, t.context([t.chat("again", session_id=closed.id)], sessions=[closed]))
    assert fresh.session.id != closed.id and fresh.session.state == SessionState.OPEN


def fold_once(*events):
    calls = []

    async def fold(sources, session_id=None):
        calls.append(list(sources))
        return list(events) if len(calls) == 1 else []

    return fold, calls


def test_fold_adds_a_message_that_arrived_mid_run_to_the_same_run(serve):
    server = serve([say("second", "got the second"), END_AFTER_SEND, say("first", "got the first")])
    late = t.chat("second")
    fold, calls = fold_once(late)
    [result] = run(server, t.context([t.chat("first")], fold=fold), event_policies="chat=fold")

    assert result.messages == [OutMessage("got the first", False), OutMessage("got the second", False)]
    assert result.folded_event_ids == [late.id]
    assert calls[0] == ["chat"]
    turn = server.requests()[1]["messages"][-1]["content"]
    assert turn[0]["type"] == "tool_result" and '"text": "second"' in turn[1]["text"]


def test_queue_is_the_default_and_never_folds(serve):
    server = serve([END_AFTER_SEND, say("first", "got the first")])
    fold, calls = fold_once(t.chat("second"))
    [result] = run(server, t.context([t.chat("first")], fold=fold))
    assert calls == [] and result.folded_event_ids == []


def test_interrupt_drops_the_draft_and_starts_over(serve):
    server = serve(
        [
            say("start over", "the pager says the site is down"),
            END_AFTER_SEND,
            say("first", "a draft nobody should see"),
        ]
    )
    page = t.event("pager.alert", {"text": "site down"}, source="pager")
    fold, _ = fold_once(page)
    [result] = run(server, t.context([t.chat("first")], fold=fold), event_policies="pager=interrupt")

    assert result.messages == [OutMessage("the pager says the site is down", False)]
    assert result.folded_event_ids == [page.id]
    assert "a draft nobody should see" not in json.dumps(result.session.messages)
