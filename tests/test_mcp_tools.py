"""Tools from MCP servers: a real server on the official SDK (tests/mcp_test_server.py), over
stdio and over streamable HTTP on 127.0.0.1, behind the real agent and the scripted
Messages API."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otlp_support import ERROR
from vigil.agent.actions import ToolRegistry, effective_permissions
from vigil.agent.mcp_tools import Connection, ServerDown
from vigil.agent.settings import McpServer
from vigil.agent.tools import CallContext
from vigil.ledger.states import RunOutcome
from vigil.outbound import AddressPolicy
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

SERVER = Path(__file__).resolve().parent / "mcp_test_server.py"
LOOPBACK = "127.0.0.0/8"
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    def __init__(self, log: Path):
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), "http", str(self.port), str(log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("the MCP test server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "calls.jsonl"
    path.touch()
    return path


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture
def http(log):
    server = HttpServer(log)
    yield server
    server.stop()


@pytest.fixture(params=["stdio", "http"])
def servers(request, log):
    """VIGIL_MCP_SERVERS naming the test server over one transport."""
    if request.param == "stdio":
        yield {"orders": {"command": sys.executable, "args": [str(SERVER), "stdio", str(log)]}}
        return
    server = HttpServer(log)
    yield {"orders": {"url": server.url}}
    server.stop()


@pytest.fixture(scope="module")
def model():
    with ScriptedServer([]) as s:
        yield s


def use(name, **tool_input):
    return {"type": "tool_use", "name": name, "input": tool_input}


SCRIPT = [
    {"when": {"tool_result": "send_message"}, "reply": []},
    {
        "when": {"tool_result_error": True, "tool_result_text": r"(did not answer[^.]*)"},
        "reply": [use("send_message", text="failed: {1}")],
    },
    {
        "when": {"tool_result": "orders__lookup", "tool_result_text": r"(order \w+ shipped)"},
        "reply": [use("send_message", text="{1}")],
    },
    {"when": {"user_text": "cancel"}, "reply": [use("orders__cancel_order", order_id="A17")]},
    {"reply": [use("orders__lookup", order_id="A17")]},
]


def run(model, servers, *ctxs, **overrides):
    model.set_script(SCRIPT)
    model.clear()
    overrides.setdefault("outbound_allowed_nets", LOOPBACK)
    return t.run(model.base_url, *ctxs, mcp_servers=json.dumps(servers), **overrides)


def test_tools_reach_the_model_and_a_call_carries_the_run_key(model, servers, log):
    ctx = t.context([t.chat("where is A17?")])
    [result] = run(model, servers, ctx)

    offered = {tool["name"]: tool for tool in model.requests()[0]["tools"]}
    assert offered["orders__lookup"]["input_schema"]["properties"]["order_id"]["type"] == "string"
    assert {"orders__cancel_order", "orders__big"} <= set(offered)
    assert [m.text for m in result.messages] == ["order A17 shipped"]
    [call] = calls(log)
    assert call["tool"] == "lookup" and call["args"] == {"order_id": "A17"}
    assert call["meta"]["idempotency_key"].startswith(ctx.run_key + ":")


def test_permissions_follow_the_annotations_and_are_listed(servers):
    settings = t.settings(mcp_servers=json.dumps(servers), outbound_allowed_nets=LOOPBACK)
    registry = ToolRegistry.from_settings(settings)
    rows = {row["name"]: row for row in registry.listing(effective_permissions(settings, registry.tools))}
    assert rows["orders__lookup"] == {
        "name": "orders__lookup",
        "source": "mcp:orders",
        "version": "2.0.1",
        "permission": "allow",
    }
    assert rows["orders__cancel_order"]["permission"] == "ask"  # destructive
    assert rows["orders__big"]["permission"] == "ask"  # no read-only annotation


def test_a_destructive_tool_asks_for_approval_and_runs_nothing(model, servers, log):
    [result] = run(model, servers, t.context([t.chat("please cancel A17")]))
    assert result.outcome is RunOutcome.DEFERRED
    [approval] = result.approvals
    assert approval.tool == "orders__cancel_order"
    assert any("orders__cancel_order" in m.text for m in result.messages)  # the question
    assert calls(log) == []


def test_a_down_server_is_an_error_result_the_model_reads(model, http, log):
    async def go():
        agent = t.agent(
            model.base_url, mcp_servers=json.dumps({"orders": {"url": http.url}}), outbound_allowed_nets=LOOPBACK
        )
        try:
            http.stop()  # listed at start-up, gone by the call
            return await agent.run(t.context([t.chat("where is A17?")]))
        finally:
            await agent.close()

    model.set_script(SCRIPT)
    result = asyncio.run(go())
    [message] = result.messages
    assert message.text.startswith("failed: did not answer"), message.text


def test_a_slow_call_and_a_long_result_are_bounded(servers, log):
    settings = t.settings(
        mcp_servers=json.dumps(servers),
        outbound_allowed_nets=LOOPBACK,
        mcp_max_result_bytes=1000,
        mcp_timeout_s=2,
    )
    tools = {tool.name: tool for tool in ToolRegistry.from_settings(settings).tools}

    async def go():
        big = await tools["orders__big"].run({}, CallContext("u1", "toolu_1", "k1"))
        started = time.monotonic()
        slow = await tools["orders__slow"].run({}, CallContext("u1", "toolu_2", "k2"))
        waited = time.monotonic() - started
        # A stdio server is started again after a call that timed out; it answers the next one.
        again = await tools["orders__big"].run({}, CallContext("u1", "toolu_3", "k3"))
        await tools["orders__big"].connection.close()
        return big, slow, waited, again

    big, slow, waited, again = asyncio.run(go())
    assert len(big.text) < 1100 and "[cut: the result was 100000 bytes, 1000 shown]" in big.text
    assert slow.is_error and "did not answer: no answer within 2 s" in slow.text and waited < 5
    assert not again.is_error


def test_the_address_policy_refuses_a_server_on_a_forbidden_address(http, log):
    settings = t.settings(mcp_servers=json.dumps({"orders": {"url": http.url}}), outbound_allowed_nets="")
    registry = ToolRegistry.from_settings(settings)
    assert [tool.name for tool in registry.tools if tool.name.startswith("orders")] == []
    assert "outbound address policy" in registry.unreachable["orders"]
    connection = Connection(McpServer("orders", url=http.url), settings, AddressPolicy())
    with pytest.raises(ServerDown, match="outbound address policy"):
        asyncio.run(connection.call("lookup", {"order_id": "A17"}, "k1"))
    assert calls(log) == []


def test_model_and_tool_spans_follow_the_genai_conventions(model, http, exporter):
    run(model, {"orders": {"url": http.url}}, t.context([t.chat("where is A17?")]))

    spans = exporter.get_finished_spans()
    chats = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(chats) == 3  # lookup, send_message, then the end
    first = chats[0]
    assert first.name == f"chat {t.SCRIPTED_MODEL}"
    attributes = dict(first.attributes)
    assert attributes["gen_ai.request.model"] == t.SCRIPTED_MODEL
    assert attributes["gen_ai.response.model"] == t.SCRIPTED_MODEL
    assert attributes["gen_ai.provider.name"] == attributes["gen_ai.system"] == "anthropic"
    assert attributes["gen_ai.usage.input_tokens"] > 0 and attributes["gen_ai.usage.output_tokens"] > 0
    # Cached tokens counted in, as the conventions ask (the API's input_tokens leaves them out).
    last = dict(chats[-1].attributes)
    cached = last["gen_ai.usage.cache_read.input_tokens"] + last["gen_ai.usage.cache_creation.input_tokens"]
    assert cached > 0 and last["gen_ai.usage.input_tokens"] > cached
    tools = {s.name: dict(s.attributes) for s in spans if s.attributes.get("gen_ai.operation.name") == "execute_tool"}
    lookup = tools["execute_tool orders__lookup"]
    assert lookup["gen_ai.tool.name"] == "orders__lookup" and lookup["gen_ai.tool.call.id"].startswith("toolu_")
    assert lookup["mcp.server.name"] == "orders" and lookup["mcp.tool.name"] == "lookup"
    assert lookup["server.address"] == "127.0.0.1" and lookup["gen_ai.tool.type"] == "extension"
    assert lookup["mcp.method.name"] == "tools/call"
    assert tools["execute_tool send_message"]["gen_ai.tool.name"] == "send_message"


def test_the_tools_that_act_are_all_but_the_read_only_ones(model, servers):
    """What the worker's start-up check refuses to run without a journal (VIGIL_RUN_JOURNAL):
    every tool not annotated read-only, and whatever a server down at start may offer."""
    down = {"closed": {"url": f"http://127.0.0.1:{free_port()}/mcp"}}
    agent = t.agent(model.base_url, mcp_servers=json.dumps(servers | down), outbound_allowed_nets=LOOPBACK)
    try:
        acting = agent.acting_tools()
    finally:
        asyncio.run(agent.close())
    assert {"orders__cancel_order", "orders__big"} <= set(acting)
    assert "orders__lookup" not in acting and "orders__slow" not in acting
    assert "closed__* (MCP server not listed at start)" in acting


def test_a_tool_span_names_its_decision_and_a_blocked_call_is_not_a_tool_error(model, http, exporter):
    """A deferred call's span says so (it ran nothing), and a call the safety policy blocked
    has its own error.type, apart from a tool that answered with an error."""
    from opentelemetry.trace import StatusCode

    servers = {"orders": {"url": http.url}}

    def tool_spans(name: str) -> list:
        return [s for s in exporter.get_finished_spans() if s.name == f"execute_tool {name}"]

    [deferred] = run(model, servers, t.context([t.chat("please cancel A17")]))
    assert deferred.outcome is RunOutcome.DEFERRED
    [asked] = tool_spans("orders__cancel_order")
    assert asked.attributes["vigil.tool.decision"] == "ask"
    assert asked.status.status_code is StatusCode.UNSET and "error.type" not in asked.attributes
    assert "mcp.method.name" not in asked.attributes  # nothing was sent to the server

    exporter.clear()
    run(model, servers, t.context([t.chat("please cancel A17")]), tool_permissions="orders__cancel_order=auto")
    blocked = tool_spans("orders__cancel_order")[0]  # the script asks again: blocks, then the fallback to ask
    assert blocked.attributes["vigil.tool.decision"] == "block"
    assert blocked.status.status_code is StatusCode.ERROR and blocked.attributes["error.type"] == "blocked"
    assert "mcp.method.name" not in blocked.attributes  # nothing was sent to the server

    async def down_by_the_call():
        agent = t.agent(model.base_url, mcp_servers=json.dumps(servers), outbound_allowed_nets=LOOPBACK)
        try:
            http.stop()  # listed at start-up, gone by the call: its error result is a tool error
            return await agent.run(t.context([t.chat("where is A17?")]))
        finally:
            await agent.close()

    exporter.clear()
    asyncio.run(down_by_the_call())
    failed = tool_spans("orders__lookup")[0]
    assert failed.attributes["vigil.tool.decision"] == "run"
    assert failed.status.status_code is StatusCode.ERROR and failed.attributes["error.type"] == "tool_error"
    assert failed.attributes["mcp.method.name"] == "tools/call"  # sent, unanswered


def died_after_the_lookup(model, servers):
    """Run "where is A17?" once, journaled. Returns its replay, to call: the run again, as the
    next owner makes it when the first attempt died right after the lookup."""
    from dataclasses import replace

    from test_journal import Recording
    from vigil.agent.journal import Journal

    ctx = t.context([t.chat("where is A17?")])
    first = Recording()
    run(model, servers, replace(ctx, journal=Journal(ctx.run_key, first)))
    died = [s for s in first.steps() if s.step <= 2]
    assert [s.kind for s in died] == ["model", "call"]
    return lambda: run(model, servers, replace(ctx, journal=Journal.of(ctx.run_key, None, died)))


def test_a_replayed_step_is_marked_and_no_span_pretends_it_was_made_again(model, http, log, exporter):
    """A run replayed after its first attempt died (the journal it wrote up to the lookup's
    outcome, as the next owner reads it back): the journaled answer and lookup are not made
    again, and their spans say so, with no duration, no GenAI operation and no usage (nothing
    was asked or billed); the steps made live after them have their ordinary spans."""
    servers = {"orders": {"url": http.url}}
    replay = died_after_the_lookup(model, servers)
    looked_up = len(calls(log))

    exporter.clear()
    [result] = replay()
    assert [m.text for m in result.messages] == ["order A17 shipped"]
    assert len(calls(log)) == looked_up and len(model.requests()) == 2  # made and asked once each

    spans = exporter.get_finished_spans()
    [agent] = [s for s in spans if s.name.startswith("invoke_agent ")]
    marks = [s for s in spans if s.attributes.get("vigil.replayed")]
    assert [(s.name, s.attributes["vigil.journal.step"]) for s in marks] == [
        ("replayed chat", 1),
        ("replayed execute_tool orders__lookup", 2),
    ]
    for mark in marks:
        assert mark.parent.span_id == agent.context.span_id and mark.end_time == mark.start_time
        assert "gen_ai.operation.name" not in mark.attributes
        assert not [key for key in mark.attributes if key.startswith("gen_ai.usage.")]
    live = [(s.attributes["gen_ai.operation.name"], s.name) for s in spans if "gen_ai.operation.name" in s.attributes]
    assert live == [
        ("chat", f"chat {t.SCRIPTED_MODEL}"),  # the question after the lookup's result, asked live
        ("execute_tool", "execute_tool send_message"),
        ("chat", f"chat {t.SCRIPTED_MODEL}"),
        ("invoke_agent", "invoke_agent default"),
    ]


def test_a_blocked_call_reads_correctly_in_an_otlp_receiver(model, http, otlp):
    """What a tracing backend is sent over OTLP for a call the safety policy blocked."""
    run(
        model,
        {"orders": {"url": http.url}},
        t.context([t.chat("cancel A17")]),
        tool_permissions="orders__cancel_order=auto",
    )
    otlp.flush()
    blocked = otlp.named("execute_tool orders__cancel_order")[0]  # then the fallback asks
    assert blocked.attributes["vigil.tool.decision"] == "block" and blocked.attributes["error.type"] == "blocked"
    assert blocked.status == ERROR and blocked.attributes["mcp.server.name"] == "orders"


def test_a_replayed_run_reads_correctly_in_an_otlp_receiver(model, http, otlp):
    """What a tracing backend is sent over OTLP for a replayed run: its journaled steps are marks
    of no duration under the run's conversation, with no GenAI operation and no usage."""
    replay = died_after_the_lookup(model, {"orders": {"url": http.url}})
    replay()
    otlp.flush()
    marks = sorted((s for s in otlp.spans if s.attributes.get("vigil.replayed") is True), key=lambda s: s.start)
    assert [(s.name, s.attributes["vigil.journal.step"]) for s in marks] == [
        ("replayed chat", 1),
        ("replayed execute_tool orders__lookup", 2),
    ]
    [agent] = [s for s in otlp.trace(marks[0].trace_id) if s.name.startswith("invoke_agent ")]
    for mark in marks:
        assert mark.parent == agent.span_id and mark.end == mark.start
        assert not [key for key in mark.attributes if key.startswith(("gen_ai.usage.", "gen_ai.operation."))]
