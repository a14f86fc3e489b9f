"""The offline Claude, driven by the real anthropic SDK: wire format, tool use, errors, caching."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
try:
    from vigil_dev import scripted_server
except ModuleNotFoundError:  # running from a checkout without the package installed
    sys.path.insert(0, str(ROOT / "services"))
    from vigil_dev import scripted_server

# After the path fallback above, hence E402.
from vigil_dev.scripted_server import DEMO_SCRIPT_PATH, ScriptedServer, ScriptError, compile_script  # noqa: E402

MODEL = "claude-scripted-1"
SEND_MESSAGE = {
    "name": "send_message",
    "description": "Send a message to the user.",
    "input_schema": {
        "type": "object",
        "properties": {"text": {"type": "string"}, "urgent": {"type": "boolean"}},
        "required": ["text"],
    },
}
SET_FOLLOWUP = {
    "name": "set_followup",
    "description": "Wake me up later.",
    "input_schema": {
        "type": "object",
        "properties": {"delay_seconds": {"type": "integer"}, "note": {"type": "string"}},
        "required": ["delay_seconds", "note"],
    },
}
REFUND = {
    "name": "refund",
    "description": "Refund an order.",
    "input_schema": {
        "type": "object",
        "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
        "required": ["order_id", "amount"],
    },
}
MEMORY = {"type": "memory_20250818", "name": "memory"}
AGENT_TOOLS = [SEND_MESSAGE, SET_FOLLOWUP, MEMORY, REFUND]


@pytest.fixture(scope="module")
def shared_server():
    # One server for the module: starting and stopping uvicorn per test would dominate the run time.
    with ScriptedServer([]) as server:
        yield server


@pytest.fixture
def serve(shared_server):
    """serve(script) -> the running ScriptedServer, now answering from script with no requests recorded."""

    def use(script) -> ScriptedServer:
        shared_server.set_script(script)
        shared_server.clear()
        return shared_server

    return use


@functools.cache
def _client(base_url: str, max_retries: int) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="sk-test-not-real", max_retries=max_retries)


def client(server: ScriptedServer, max_retries: int = 0) -> anthropic.Anthropic:
    # Clients are cached because building one (TLS context and all) costs more than a request here.
    return _client(server.base_url, max_retries)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# ---------------------------------------------------------------------------- replies


def test_text_reply(serve):
    server = serve(
        [
            {
                "when": {"user_text": r"(?i)hello (?P<who>\w+)"},
                "reply": [{"type": "text", "text": "Hi {who}, {{literally}} {unknown}"}],
            }
        ]
    )
    msg = client(server).messages.create(model=MODEL, max_tokens=256, messages=[user("hello Ada")])

    assert isinstance(msg, anthropic.types.Message)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hi Ada, {literally} {unknown}"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    assert msg.usage.cache_creation_input_tokens == 0 and msg.usage.cache_read_input_tokens == 0
    assert msg._request_id and msg._request_id.startswith("req_")


def test_history_matches_the_earlier_user_turns_only(serve):
    server = serve(
        [
            {
                "when": {"user_text": "what did I say", "history": r"my name is (?P<name>\w+)"},
                "reply": [{"type": "text", "text": "You are {name}."}],
            },
            {"reply": [{"type": "text", "text": "No idea."}]},
        ]
    )
    earlier = [user("my name is Ada"), {"role": "assistant", "content": "Hello."}]
    said = client(server).messages.create(model=MODEL, max_tokens=64, messages=[*earlier, user("what did I say?")])
    alone = client(server).messages.create(
        model=MODEL, max_tokens=64, messages=[user("my name is Ada. what did I say?")]
    )
    assert [said.content[0].text, alone.content[0].text] == ["You are Ada.", "No idea."]


def test_tool_use_round_trip(serve):
    server = serve(
        [
            {
                "when": {"tool_result": "send_message", "tool_result_text": r"queued as (\d+)"},
                "reply": [{"type": "text", "text": "sent, id {1}"}],
            },
            {
                "when": {"user_text": r"tell (?P<who>\w+) (?P<what>.+)"},
                "reply": [
                    {"type": "text", "text": "On it."},
                    {"type": "tool_use", "name": "send_message", "input": {"text": "{who}: {what}", "urgent": False}},
                ],
            },
        ]
    )
    c = client(server)
    messages = [user("tell Bob lunch is ready")]
    first = c.messages.create(model=MODEL, max_tokens=256, tools=[SEND_MESSAGE], messages=messages)

    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert isinstance(call, anthropic.types.ToolUseBlock)
    assert call.id.startswith("toolu_") and call.name == "send_message"
    assert call.input == {"text": "Bob: lunch is ready", "urgent": False}

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "queued as 7"}]},
    ]
    second = c.messages.create(model=MODEL, max_tokens=256, tools=[SEND_MESSAGE], messages=messages)
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "sent, id 7"


def test_async_client_round_trip(serve):
    server = serve(
        [
            {
                "when": {"tool_result": "set_followup", "tool_result_error": True},
                "reply": [{"type": "text", "text": "failed"}],
            },
            {"when": {"tool_result": "set_followup"}, "reply": []},
            {
                "when": {"user_text": r"in (?P<n>\d+)s"},
                "reply": [
                    {"type": "tool_use", "name": "set_followup", "input": {"delay_seconds": "{n:int}", "note": "n={n}"}}
                ],
            },
        ]
    )

    async def talk() -> tuple[anthropic.types.Message, anthropic.types.Message]:
        async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key="sk-test", max_retries=0) as c:
            messages = [user("ping me in 5s")]
            first = await c.messages.create(model=MODEL, max_tokens=256, tools=[SET_FOLLOWUP], messages=messages)
            call = first.content[0]
            messages += [
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": call.id,
                            "content": [{"type": "text", "text": "scheduled"}],
                        }
                    ],
                },
            ]
            second = await c.messages.create(model=MODEL, max_tokens=256, tools=[SET_FOLLOWUP], messages=messages)
            return first, second

    first, second = asyncio.run(talk())
    assert first.content[0].input == {"delay_seconds": 5, "note": "n=5"}
    assert second.stop_reason == "end_turn" and second.content == []


def test_rule_calling_a_tool_not_offered_is_skipped(serve):
    server = serve(
        [
            {"reply": [{"type": "tool_use", "name": "refund", "input": {"order_id": "1", "amount": 1}}]},
            {"reply": [{"type": "text", "text": "no tools"}]},
        ]
    )
    c = client(server)
    assert c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")]).content[0].text == "no tools"
    offered = c.messages.create(model=MODEL, max_tokens=64, tools=[REFUND], messages=[user("x")])
    assert offered.content[0].name == "refund"
    refused = c.messages.create(
        model=MODEL, max_tokens=64, tools=[REFUND], tool_choice={"type": "none"}, messages=[user("x")]
    )
    assert refused.content[0].text == "no tools"


def test_long_reply_is_cut_at_max_tokens(serve):
    server = serve(
        [
            {
                "reply": [
                    {"type": "text", "text": "word " * 100},
                    {"type": "tool_use", "name": "send_message", "input": {"text": "late"}},
                ]
            }
        ]
    )
    msg = client(server).messages.create(model=MODEL, max_tokens=10, tools=[SEND_MESSAGE], messages=[user("x")])
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["text"] and len(msg.content[0].text) < 50


# ---------------------------------------------------------------------------- errors


def test_429_twice_then_success(serve):
    server = serve(
        [
            {"times": 2, "error": {"status": 429, "message": "slow down", "retry_after": 3}},
            {"reply": [{"type": "text", "text": "finally"}]},
        ]
    )
    c = client(server)
    for _ in range(2):
        with pytest.raises(anthropic.RateLimitError) as info:
            c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "3"
        assert info.value.body["error"] == {"type": "rate_limit_error", "message": "slow down"}
    assert c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")]).content[0].text == "finally"


def test_sdk_retries_through_429s_on_its_own(serve):
    server = serve(
        [
            {"times": 2, "error": {"status": 429, "retry_after": 0.01}},
            {"reply": [{"type": "text", "text": "ok"}]},
        ]
    )
    msg = client(server, max_retries=2).messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
    assert msg.content[0].text == "ok"
    assert len(server.requests()) == 3


def test_529_forever(serve):
    server = serve([{"error": {"status": 529}}])
    c = client(server)
    for _ in range(3):
        with pytest.raises(anthropic.InternalServerError) as info:
            c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
        assert isinstance(info.value, anthropic.APIStatusError)
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"
        assert "retry-after" in info.value.response.headers


def test_500_api_error(serve):
    server = serve([{"times": 1, "error": {"status": 500}}, {"reply": []}])
    with pytest.raises(anthropic.InternalServerError) as info:
        client(server).messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
    assert info.value.status_code == 500 and info.value.body["error"]["type"] == "api_error"
    assert "retry-after" not in info.value.response.headers


def test_no_matching_rule_is_a_500_the_sdk_does_not_retry(serve):
    server = serve([{"when": {"user_text": "never"}, "reply": []}])
    with pytest.raises(anthropic.InternalServerError) as info:
        client(server, max_retries=3).messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
    assert "no script rule matched" in info.value.message
    assert len(server.requests()) == 1


def test_invalid_transcripts_are_rejected_like_the_real_api(serve):
    server = serve([{"reply": [{"type": "text", "text": "unreachable"}]}])
    c = client(server)
    call = {"type": "tool_use", "id": "toolu_x", "name": "send_message", "input": {"text": "hi"}}

    unanswered = [user("a"), {"role": "assistant", "content": [call]}, user("b")]
    with pytest.raises(anthropic.BadRequestError, match="without `tool_result` blocks"):
        c.messages.create(model=MODEL, max_tokens=64, tools=[SEND_MESSAGE], messages=unanswered)

    orphan = [
        user("a"),
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]},
    ]
    with pytest.raises(anthropic.BadRequestError, match="unexpected `tool_use_id`"):
        c.messages.create(model=MODEL, max_tokens=64, tools=[SEND_MESSAGE], messages=orphan)

    empty_turn = [user("a"), {"role": "assistant", "content": []}, user("b")]
    with pytest.raises(anthropic.BadRequestError, match="non-empty content"):
        c.messages.create(model=MODEL, max_tokens=64, messages=empty_turn)

    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        c.messages.create(model=MODEL, max_tokens=0, messages=[user("a")])
    with pytest.raises(anthropic.BadRequestError, match="unique"):
        c.messages.create(model=MODEL, max_tokens=64, tools=[SEND_MESSAGE, SEND_MESSAGE], messages=[user("a")])

    cc = {"type": "ephemeral"}
    too_many = [{"type": "text", "text": f"s{i}", "cache_control": cc} for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4"):
        c.messages.create(model=MODEL, max_tokens=64, system=too_many, messages=[user("a")])


def test_headers_are_checked(serve):
    server = serve([{"reply": []}])
    body = {"model": MODEL, "max_tokens": 8, "messages": [user("x")]}
    url = server.base_url + "/v1/messages"
    http = httpx.Client()

    no_key = http.post(url, json=body, headers={"anthropic-version": "2023-06-01"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    no_version = http.post(url, json=body, headers={"x-api-key": "k"})
    assert no_version.status_code == 400 and no_version.json()["error"]["type"] == "invalid_request_error"
    both = http.post(url, json=body, headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    assert both.status_code == 200 and both.json()["type"] == "message"
    missing_model = http.post(
        url,
        json={"max_tokens": 8, "messages": [user("x")]},
        headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
    )
    assert missing_model.status_code == 400 and "model" in missing_model.json()["error"]["message"]
    nowhere = http.get(server.base_url + "/v1/models")
    assert nowhere.status_code == 404 and nowhere.json()["type"] == "error"


# ---------------------------------------------------------------------------- caching


def test_prompt_cache_creation_then_read(serve):
    server = serve([{"reply": [{"type": "text", "text": "ok"}]}])
    c = client(server)
    cc = {"type": "ephemeral"}
    tools = [SEND_MESSAGE, {**SET_FOLLOWUP, "cache_control": cc}]
    system = [{"type": "text", "text": "You are vigil. " * 50, "cache_control": cc}]
    first_turn = {"role": "user", "content": [{"type": "text", "text": "event one " * 40, "cache_control": cc}]}

    one = c.messages.create(model=MODEL, max_tokens=64, tools=tools, system=system, messages=[first_turn]).usage
    assert one.cache_read_input_tokens == 0 and one.cache_creation_input_tokens > 100
    assert one.cache_creation.ephemeral_5m_input_tokens == one.cache_creation_input_tokens

    two = c.messages.create(model=MODEL, max_tokens=64, tools=tools, system=system, messages=[first_turn]).usage
    assert two.cache_read_input_tokens == one.cache_creation_input_tokens
    assert two.cache_creation_input_tokens == 0
    assert two.input_tokens == one.input_tokens

    # The conversation grows and the marker moves to the newest turn: the old prefix is still read
    # (the marker itself is not part of the cached content), only the new part is written.
    grown = [
        {"role": "user", "content": [{"type": "text", "text": "event one " * 40}]},
        {"role": "assistant", "content": "noted"},
        {"role": "user", "content": [{"type": "text", "text": "event two " * 40, "cache_control": cc}]},
    ]
    three = c.messages.create(model=MODEL, max_tokens=64, tools=tools, system=system, messages=grown).usage
    assert three.cache_read_input_tokens == one.cache_creation_input_tokens
    assert 0 < three.cache_creation_input_tokens < one.cache_creation_input_tokens

    # A different system prompt shares only the tools prefix.
    other = [{"type": "text", "text": "You are someone else.", "cache_control": cc}]
    four = c.messages.create(model=MODEL, max_tokens=64, tools=tools, system=other, messages=[user("x")]).usage
    assert 0 < four.cache_read_input_tokens < one.cache_creation_input_tokens
    assert four.cache_creation_input_tokens > 0


def test_no_cache_control_means_no_caching(serve):
    server = serve([{"reply": []}])
    c = client(server)
    for _ in range(2):
        usage = c.messages.create(model=MODEL, max_tokens=64, system="plain " * 50, messages=[user("x")]).usage
        assert usage.cache_read_input_tokens == 0 and usage.cache_creation_input_tokens == 0


# ---------------------------------------------------------------------------- introspection


def test_requests_introspection_and_runtime_script(serve):
    server = serve([{"reply": [{"type": "text", "text": "one"}]}])
    c = client(server)
    c.messages.create(model=MODEL, max_tokens=64, system="sys", messages=[user("first")])
    c.messages.create(model=MODEL, max_tokens=32, messages=[user("second")])

    http = httpx.Client()
    over_http = http.get(server.base_url + "/_requests").json()
    assert over_http == server.requests()
    assert [r["messages"][0]["content"] for r in over_http] == ["first", "second"]
    assert over_http[0]["system"] == "sys" and over_http[1]["max_tokens"] == 32

    assert http.delete(server.base_url + "/_requests").status_code == 204
    assert server.requests() == []

    new_script = {"rules": [{"reply": [{"type": "text", "text": "two"}]}]}
    assert http.put(server.base_url + "/_script", json=new_script).status_code == 204
    assert http.get(server.base_url + "/_script").json() == new_script
    assert c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")]).content[0].text == "two"

    server.set_script([{"reply": [{"type": "text", "text": "three"}]}])
    assert c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")]).content[0].text == "three"
    assert len(server.requests()) == 2
    server.clear()
    assert server.requests() == []

    bad = http.put(server.base_url + "/_script", json={"rules": [{"when": {"user_text": "("}}]})
    assert bad.status_code == 400 and "bad regex" in bad.json()["error"]["message"]


def test_set_script_resets_times(serve):
    script = [{"times": 1, "error": {"status": 429}}, {"reply": []}]
    server = serve(script)
    c = client(server)
    with pytest.raises(anthropic.RateLimitError):
        c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
    c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
    server.set_script(script)
    with pytest.raises(anthropic.RateLimitError):
        c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")])


def test_secrets_are_not_logged(serve, caplog):
    caplog.set_level(logging.DEBUG)
    server = serve([{"when": {"user_text": "never"}, "reply": []}, {"error": {"status": 529}}])
    secret = "sk-live-SECRET-4f9a"
    c = anthropic.Anthropic(base_url=server.base_url, api_key=secret, max_retries=0)
    with pytest.raises(anthropic.InternalServerError):
        c.messages.create(model=MODEL, max_tokens=64, system=f"token {secret}", messages=[user(f"my {secret}")])
    server.set_script([{"when": {"user_text": "never"}, "reply": []}])
    with pytest.raises(anthropic.InternalServerError):
        c.messages.create(model=MODEL, max_tokens=64, messages=[user(f"my {secret}")])
    server_records = [r for r in caplog.records if r.name.startswith(("vigil", "uvicorn"))]
    assert server_records, "expected the server to log something about the requests"
    assert all(secret not in r.getMessage() for r in server_records)


def test_a_delay_range_draws_each_answer_s_wait(serve):
    """[low, high]: every answer waits at least low and about at most high, and not all the same
    (the model-bound bench relies on the spread to keep a backlog's runs out of lockstep)."""
    server = serve([{"delay": [0.05, 0.45], "reply": [{"type": "text", "text": "ok"}]}])
    took = []
    for _ in range(8):
        began = time.monotonic()
        client(server).messages.create(model=MODEL, max_tokens=16, messages=[user("hi")])
        took.append(time.monotonic() - began)
    assert min(took) >= 0.05 and max(took) < 0.45 + 0.5, took
    assert max(took) - min(took) > 0.05, took


def test_a_held_answer_waits_for_its_file(serve, tmp_path):
    """ "hold": the rebalance bench holds a wave of runs in flight until a second worker's join
    is under way, however long that worker takes to start on a loaded machine."""
    hold = tmp_path / "release"
    server = serve([{"hold": str(hold), "reply": [{"type": "text", "text": "ok"}]}])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client(server).messages.create, model=MODEL, max_tokens=16, messages=[user("hi")])
        with pytest.raises(concurrent.futures.TimeoutError):
            answer.result(timeout=0.5)
        hold.touch()
        assert answer.result(timeout=10).content[0].text == "ok"


def test_script_errors_are_caught_early():
    for bad in (
        {"rules": "nope"},
        [{"reply": [{"type": "image"}]}],
        [{"when": {"user_txt": "x"}}],
        [{"reply": [], "error": {"status": 429}}],
        [{"times": -1}],
        [{"error": {"status": 200}}],
        [{"delay": -1}],
        [{"delay": [2, 1]}],
        [{"delay": [1]}],
        [{"delay": True}],
        [{"hold": 3}],
        [{"hold": ""}],
    ):
        with pytest.raises(ScriptError):
            compile_script(bad)
    with pytest.raises(ValueError):
        ScriptedServer([{"when": {"system": "["}}])


# ---------------------------------------------------------------------------- the demo script


def event_turn(kind: str, payload: dict, *, payload_as_text: bool = False) -> dict:
    # The avro envelope carries the payload as JSON text; accept either rendering.
    event = {
        "user_id": "u1",
        "source": "chat",
        "kind": kind,
        "payload": json.dumps(payload) if payload_as_text else payload,
    }
    return {"role": "user", "content": [{"type": "text", "text": json.dumps(event)}]}


def run_agent(
    c: anthropic.Anthropic,
    messages: list[dict],
    tool_results: dict[str, str],
    *,
    stop_at: str | None = None,
    max_rounds: int = 6,
) -> list[tuple[str, dict]]:
    """A miniature worker loop: call, run the tools with canned results, until the turn ends."""
    calls: list[tuple[str, dict]] = []
    for _ in range(max_rounds):
        msg = c.messages.create(
            model=MODEL, max_tokens=1024, system="You are vigil.", tools=AGENT_TOOLS, messages=messages
        )
        if msg.content:
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        uses = [b for b in msg.content if b.type == "tool_use"]
        calls += [(b.name, b.input) for b in uses]
        if msg.stop_reason != "tool_use":
            return calls
        if stop_at and any(b.name == stop_at for b in uses):
            return calls  # deferred, as the worker does for a tool that needs approval
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": b.id, "content": tool_results.get(b.name, "ok")}
                    for b in uses
                ],
            }
        )
    raise AssertionError(f"the agent looped: {calls}")


@pytest.fixture
def demo(serve):
    return client(serve(scripted_server.load_script(DEMO_SCRIPT_PATH)))


@pytest.mark.parametrize("payload_as_text", [False, True])
def test_demo_chat_message_gets_a_friendly_reply(demo, payload_as_text):
    turn = event_turn("chat.message", {"text": "good morning"}, payload_as_text=payload_as_text)
    calls = run_agent(demo, [turn], {"send_message": "queued"})
    assert calls == [("send_message", {"text": "Hi! You said: good morning", "urgent": False})]


def test_demo_remind_me_in_a_minute(demo):
    calls = run_agent(
        demo,
        [event_turn("chat.message", {"text": "remind me in a minute"})],
        {"set_followup": "follow-up scheduled", "send_message": "queued"},
    )
    assert calls == [
        ("set_followup", {"delay_seconds": 60, "note": "you asked me to remind you a minute ago."}),
        ("send_message", {"text": "OK, I will remind you.", "urgent": False}),
    ]


def test_demo_remind_me_in_seconds(demo):
    calls = run_agent(
        demo,
        [event_turn("chat.message", {"text": "remind me in 5 seconds"}, payload_as_text=True)],
        {"send_message": "queued"},
    )
    assert calls[0] == ("set_followup", {"delay_seconds": 5, "note": "you asked me to remind you 5 seconds ago."})


def test_demo_followup_timer_sends_the_reminder(demo):
    timer = event_turn("timer.followup", {"note": "you asked me to remind you a minute ago."}, payload_as_text=True)
    calls = run_agent(demo, [timer], {"send_message": "queued"})
    assert calls == [("send_message", {"text": "Reminder: you asked me to remind you a minute ago.", "urgent": True})]


def test_demo_remember(demo):
    calls = run_agent(
        demo,
        [event_turn("chat.message", {"text": "remember that my dog is called Rex"})],
        {"memory": "File created successfully at: /memories/notes.md"},
    )
    assert calls == [
        ("memory", {"command": "create", "path": "/memories/notes.md", "file_text": "my dog is called Rex\n"}),
        ("send_message", {"text": "Noted, I will remember that.", "urgent": False}),
    ]


@pytest.mark.parametrize(
    "outcome, expected",
    [
        ("approved: refund of 19.99 for order 42 issued", "Done: the refund was made."),
        ("denied by the user", "The refund was not made (approval denied)."),
        ("approval expired", "The refund was not made (approval expired)."),
    ],
)
def test_demo_refund_with_approval(demo, outcome, expected):
    messages = [event_turn("chat.message", {"text": "please refund order 42"})]
    calls = run_agent(demo, messages, {}, stop_at="refund")
    assert calls == [("refund", {"order_id": "42", "amount": 19.99})]

    # Later, the approval's outcome resumes the session as the refund's tool_result.
    refund_id = messages[-1]["content"][0]["id"]
    messages.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": refund_id,
                    "content": outcome,
                    "is_error": "approved" not in outcome,
                }
            ],
        }
    )
    calls = run_agent(demo, messages, {"send_message": "queued"})
    assert calls == [("send_message", {"text": expected, "urgent": False})]


def test_demo_other_events_end_quietly(demo):
    msg = demo.messages.create(
        model=MODEL, max_tokens=256, tools=AGENT_TOOLS, messages=[event_turn("github.push", {"ref": "main"})]
    )
    assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"]


# ---------------------------------------------------------------------------- the command line


def _command_line(tmp_path, text: str) -> tuple[list[str], dict[str, str], int]:
    """Arguments, environment and a free port to run the server's command line with a
    script that answers ``text`` to everything."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [{"reply": [{"type": "text", "text": text}]}]}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "vigil_dev.scripted_server", "--script", str(script), "--port", str(port)]
    return args, env, port


def test_command_line_entry_serves_a_script(tmp_path):
    args, env, port = _command_line(tmp_path, "from the CLI")
    proc = subprocess.Popen(
        args,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0)
        deadline = time.monotonic() + 10
        while True:
            try:
                msg = c.messages.create(model=MODEL, max_tokens=64, messages=[user("x")])
                break
            except anthropic.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not come up"
                time.sleep(0.05)
        assert msg.content[0].text == "from the CLI"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_load_mode_shares_its_port_between_processes_and_keeps_no_bodies(tmp_path):
    """``--load`` (the benchmark's model-bound workload): two processes on one port, both
    answering, neither keeping request bodies for GET /_requests."""
    args, env, port = _command_line(tmp_path, "under load")
    procs = [
        subprocess.Popen([*args, "--load"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 30
        for proc in procs:  # both bound the port (a second plain bind would have failed and exited)
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.5).close()
                    break
                except OSError:
                    time.sleep(0.05)
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0)
        for _ in range(20):  # a fresh connection each: the kernel spreads them over both processes
            fresh = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="k", max_retries=0)
            assert fresh.messages.create(model=MODEL, max_tokens=64, messages=[user("x")]).content[0].text == (
                "under load"
            )
            fresh.close()
        time.sleep(0.5)
        assert all(proc.poll() is None for proc in procs), "a --load process exited: SO_REUSEPORT not shared"
        assert httpx.get(f"http://127.0.0.1:{port}/_requests").json() == []
        assert c.messages.create(model=MODEL, max_tokens=64, messages=[user("y")]).content[0].text == "under load"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
