"""The worker's model client: the SDK on its aiohttp transport with every connection kept
alive, answers read by pydantic-core with the SDK's own reading as the fallback, and
connections reused from call to call (the scripted server counts none of this; the
client's pool does)."""

from __future__ import annotations

import asyncio
import json
import resource

import anthropic
import httpx2
import pytest
from anthropic.types import Message, ToolUseBlock

from vigil.agent import model
from vigil.agent.claude import model_client
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

REPLY = [{"type": "tool_use", "name": "send_message", "input": {"text": "On it.", "urgent": False}}]
SCRIPT = {"rules": [{"when": {"tool_result": "send_message"}, "reply": []}, {"reply": REPLY}]}


def test_the_client_keeps_as_many_connections_alive_as_it_may_open():
    settings = t.settings(model_max_connections=3000, model_keepalive_s=12.5)
    client = model_client(settings, base_url="http://127.0.0.1:9", api_key="k")
    http = client._client
    assert isinstance(http, anthropic.DefaultAioHttpClient)
    limits = http._transport.limits
    assert (limits.max_connections, limits.max_keepalive_connections, limits.keepalive_expiry) == (3000, 3000, 12.5)
    assert client.max_retries == 0  # model.create is the one retry policy
    # Thousands of sockets need the open-files limit that many systems start services below.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == resource.RLIM_INFINITY or soft >= min(3000, hard)


def test_a_low_open_files_limit_is_raised_toward_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"hard open-files limit {hard} is below what the test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        model_client(t.settings(model_max_connections=1500), base_url="http://127.0.0.1:9", api_key="k")
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised >= 1500
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_many_runs_share_kept_alive_connections():
    """40 runs of two calls each, 8 at a time, open at most 8 connections: the second call of
    a run and the next run reuse them (the SDK's default pool closed most after each call)."""
    with ScriptedServer(SCRIPT) as server:

        async def go() -> int:
            claude = t.agent(server.base_url)
            loop = asyncio.get_running_loop()
            opened = 0
            connect = loop.sock_connect

            async def counting(sock, address):
                nonlocal opened
                opened += 1
                return await connect(sock, address)

            loop.sock_connect = counting  # type: ignore[method-assign]
            gate = asyncio.Semaphore(8)

            async def one(i: int) -> None:
                async with gate:
                    result = await claude.run(t.context([t.chat(f"hi {i}", user_id=f"u{i}")], user_id=f"u{i}"))
                    assert [m.text for m in result.messages] == ["On it."]

            try:
                await asyncio.gather(*(one(i) for i in range(40)))
            finally:
                await claude.close()
            return opened

        opened = asyncio.run(go())
        assert len(server.requests()) == 80
    assert 1 <= opened <= 8


def _response(body: dict) -> httpx2.Response:
    """An answer as the SDK's ``post`` hands it to model._message (status already checked)."""
    return httpx2.Response(200, content=json.dumps(body).encode())


def _answer(content: list[dict]) -> dict:
    return {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-scripted-1",
        "content": content,
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": 7},
    }


def test_answers_are_validated_from_bytes_and_unknown_blocks_read_the_sdks_way():
    use = {"type": "tool_use", "id": "toolu_01", "name": "send_message", "input": {"text": "x"}}
    message = asyncio.run(model._message(_response(_answer([use]))))
    assert isinstance(message, Message) and isinstance(message.content[0], ToolUseBlock)
    assert (message.content[0].name, message.content[0].input, message.usage.cache_read_input_tokens) == (
        "send_message",
        {"text": "x"},
        7,
    )
    # A block type newer than this SDK: the strict schema refuses it, the SDK's lenient reading keeps it.
    future = {"type": "hologram", "data": "?"}
    message = asyncio.run(model._message(_response(_answer([use, future]))))
    assert isinstance(message, Message) and isinstance(message.content[0], ToolUseBlock)
    assert message.content[0].name == "send_message" and message.content[1].type == "hologram"


def _requests(result: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("vigil_model_requests_total", {"result": result}) or 0.0


def test_a_call_cut_short_by_a_cancel_counts_as_cancelled():
    """A run cancelled mid-call (a revoke past its grace, a shutdown's release) sent a request
    that may be billed and whose answer is lost: SREs see it as ``result="cancelled"``, not as
    nothing (a CancelledError is no Exception, so no other result counted it)."""
    slow = {"rules": [{"reply": REPLY, "delay": 30}]}
    with ScriptedServer(slow) as server:

        async def go() -> None:
            claude = t.agent(server.base_url)
            try:
                run = asyncio.create_task(claude.run(t.context([t.chat("hi", user_id="u1")], user_id="u1")))
                for _ in range(200):  # until the request is at the server
                    if server.requests():
                        break
                    await asyncio.sleep(0.025)
                assert server.requests(), "the call never reached the server"
                run.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await run
            finally:
                await claude.close()

        before = {result: _requests(result) for result in ("cancelled", "ok", "other_error")}
        asyncio.run(go())
    assert _requests("cancelled") - before["cancelled"] == 1
    assert _requests("ok") == before["ok"] and _requests("other_error") == before["other_error"]
