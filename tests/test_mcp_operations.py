"""MCP servers as operators run them (issue 56, item 1): each stdio server with its own
environment (``env``, ``cwd``, a venv of its own for a server built on ``mcp`` 1.x), its
stderr in the log line by line under its name, the real reason it failed, per-server
gauges, one reconnect-and-retry after a crash, `vigil tools list` as a check, a hanging
streamable HTTP server bounded. Real processes throughout: the official SDK's servers
(tests/mcp_test_server.py) and reference servers installed from PyPI."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import mcp_types
import pytest
from prometheus_client import REGISTRY

from support import REPO
from test_mcp_tools import calls
from vigil import logs
from vigil.agent.actions import ToolRegistry
from vigil.agent.mcp_tools import Connection, McpTool
from vigil.agent.settings import McpServer
from vigil.agent.tools import CallContext
from vigil.outbound import address_policy
from vigil_dev import agent_testing as t

SERVER = Path(__file__).resolve().parent / "mcp_test_server.py"
VENV_TOOL = REPO / "deploy" / "tools" / "mcp-server-venv.sh"
LOOPBACK = "127.0.0.0/8"
# A server that fails at start the way a real one does: a traceback on stderr, then exit 1.
BROKEN = [
    "-c",
    'import sys; sys.stderr.write(\'Traceback (most recent call last):\\n  File "server.py", line 3\\n'
    "RuntimeError: no database at /srv/orders.db\\n'); sys.exit(1)",
]
pytestmark = pytest.mark.slow


@pytest.fixture
def call_log(tmp_path):
    """Where the test server writes each call it got (read with ``calls``)."""
    (tmp_path / "calls.jsonl").touch()
    return tmp_path / "calls.jsonl"


def orders(call_log: Path, **extra) -> dict:
    return {"command": sys.executable, "args": [str(SERVER), "stdio", str(call_log)], **extra}


def registry(servers: dict, **overrides) -> ToolRegistry:
    return ToolRegistry.from_settings(
        t.settings(mcp_servers=json.dumps(servers), outbound_allowed_nets=LOOPBACK, **overrides)
    )


def call(tool, args: dict, key: str):
    async def go():
        try:
            return await tool.run(args, CallContext("u1", "toolu_1", key))
        finally:
            await tool.connection.close()

    return asyncio.run(go())


def installed(name: str, *requirements: str) -> Path:
    """The bin folder of a venv of its own holding ``requirements`` (made once per machine)."""
    uv = Path(sys.executable).parent / "uv"  # `make install` puts it in the venv
    env = {**os.environ, "VIGIL_UV": str(uv)} if uv.exists() else None
    done = subprocess.run(
        ["bash", str(VENV_TOOL), name, *requirements], capture_output=True, text=True, timeout=600, env=env
    )
    if done.returncode != 0:
        if any(s in done.stderr for s in ("Could not find a version", "Failed to establish", "Failed to fetch")):
            pytest.skip(f"PyPI unreachable, {requirements} not installed: {done.stderr.strip()[-300:]}")
        raise RuntimeError(f"{VENV_TOOL} failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def test_env_and_cwd_reach_a_stdio_server_and_vigil_introduces_itself(call_log, tmp_path, monkeypatch):
    monkeypatch.setenv("VIGIL_APPROVAL_SECRET", "the-workers-own")  # never passed on to a server
    server = orders(call_log, env={"ORDERS_REGION": "eu-west"}, cwd=str(tmp_path))
    tools = {tool.name: tool for tool in registry({"orders": server}).tools}
    result = call(tools["orders__whereami"], {}, "k1")
    assert not result.is_error, result.text
    assert f"cwd={tmp_path}" in result.text and "region=eu-west" in result.text
    [record] = calls(call_log)
    assert record["client"] == "vigil 0.1.0"


def test_a_server_built_on_mcp_1_runs_from_a_venv_of_its_own(tmp_path):
    """mcp-server-sqlite needs mcp<2; vigil's own mcp is 2.x: the server's venv keeps both."""
    bin_dir = installed("sqlite", "mcp-server-sqlite==2025.4.25", "mcp<2")
    db = tmp_path / "shop.db"
    servers = {"sqlite": {"command": str(bin_dir / "mcp-server-sqlite"), "args": ["--db-path", str(db)]}}
    found = registry(servers)
    assert found.unreachable == {}
    tools = {tool.name: tool for tool in found.tools}
    assert {"sqlite__read_query", "sqlite__write_query", "sqlite__list_tables"} <= set(tools)
    created = call(tools["sqlite__create_table"], {"query": "CREATE TABLE orders (id TEXT)"}, "k1")
    assert not created.is_error, created.text
    listed = call(tools["sqlite__list_tables"], {}, "k2")
    assert "orders" in listed.text


def test_a_server_that_does_not_know_discover_is_probed_once_and_quietly(tmp_path, caplog, monkeypatch):
    """mcp-server-sqlite (mcp 1.x) answers the SDK's ``server/discover`` probe with an error,
    after a validation warning of some 90 lines on its stderr. The worker probes it once, at
    the listing: the warning goes to DEBUG under one INFO line, and the call's connection
    uses the initialize handshake at once (no probe, no ERROR span in the run's trace)."""
    import mcp.shared._otel
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(mcp.shared._otel, "_tracer", provider.get_tracer("mcp-python-sdk"))  # the SDK's spans
    caplog.set_level(logging.DEBUG, logger="vigil.agent.mcp_tools")
    bin_dir = installed("sqlite", "mcp-server-sqlite==2025.4.25", "mcp<2")
    servers = {"sqlite": {"command": str(bin_dir / "mcp-server-sqlite"), "args": ["--db-path", str(tmp_path / "s.db")]}}
    tools = {tool.name: tool for tool in registry(servers).tools}
    assert [s.name for s in exporter.get_finished_spans() if "discover" in s.name] == ["MCP send server/discover"]
    exporter.clear()
    listed = call(tools["sqlite__list_tables"], {}, "k1")
    assert not listed.is_error, listed.text

    def logged(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "vigil.agent.mcp_tools" and r.levelno == level]

    said = [m for m in logged(logging.INFO) if "discover" in m or "validat" in m]
    assert said == [
        "MCP server sqlite does not know server/discover (older than MCP 2026-07-28): reached with the "
        "initialize handshake from now on"
    ], said
    assert any("Failed to validate request" in m for m in logged(logging.DEBUG))
    sent = exporter.get_finished_spans()
    names = [s.name for s in sent if s.name.startswith("MCP send ")]
    assert names[:2] == ["MCP send initialize", "MCP send tools/call list_tables"], names
    assert "MCP send server/discover" not in names
    assert [s.name for s in sent if s.status.status_code is StatusCode.ERROR] == []


def test_the_reference_time_server_from_pypi_is_named_and_called():
    bin_dir = installed("time", "mcp-server-time==2026.10.19")
    servers = {"time": {"command": str(bin_dir / "mcp-server-time"), "args": ["--local-timezone", "UTC"]}}
    tools = {tool.name: tool for tool in registry(servers).tools}
    result = call(tools["time__get_current_time"], {"timezone": "Europe/Paris"}, "k1")
    assert not result.is_error and "Europe/Paris" in result.text, result.text


def test_the_reference_git_server_from_pypi_lists_its_tools_and_reads_a_repository(tmp_path):
    bin_dir = installed("git", "mcp-server-git==2026.10.19")
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "notes.txt").write_text("remember the milk\n")
    servers = {"git": {"command": str(bin_dir / "mcp-server-git"), "args": ["--repository", str(repo)]}}
    tools = {tool.name: tool for tool in registry(servers).tools}
    assert {"git__git_status", "git__git_log", "git__git_diff_unstaged", "git__git_commit"} <= set(tools), tools
    result = call(tools["git__git_status"], {"repo_path": str(repo)}, "k1")
    assert not result.is_error and "notes.txt" in result.text, result.text


def test_a_servers_stderr_is_logged_line_by_line_under_its_name(call_log, caplog):
    caplog.set_level(logging.INFO, logger="vigil.agent.mcp_tools")
    registry({"orders": orders(call_log)})
    lines = [
        (r.getMessage(), getattr(r, "mcp_server", None))
        for r in caplog.records
        if getattr(r, "event", None) == "mcp_stderr"
    ]
    assert ("MCP server orders: orders: starting", "orders") in lines
    assert ("MCP server orders: orders: ready for calls", "orders") in lines


def test_a_server_that_fails_at_start_says_why_and_its_gauges_say_down(call_log):
    found = registry({"orders": orders(call_log), "broken": {"command": sys.executable, "args": BROKEN}})
    reason = found.unreachable["broken"]
    assert "RuntimeError: no database at /srv/orders.db" in reason and "ExceptionGroup" not in reason, reason
    assert REGISTRY.get_sample_value("vigil_mcp_server_up", {"server": "broken"}) == 0
    assert REGISTRY.get_sample_value("vigil_mcp_server_up", {"server": "orders"}) == 1
    assert REGISTRY.get_sample_value("vigil_mcp_server_tools", {"server": "orders"}) == len(
        [tool for tool in found.tools if tool.name.startswith("orders__")]
    )


def test_the_workers_log_says_why_a_server_offers_no_tools(caplog):
    """The start-up WARNING, as the worker's JSON log writes it, carries the server's own failure
    (its stderr's last lines), not only the SDK's wrapper around it."""
    caplog.set_level(logging.WARNING, logger="vigil.agent.mcp_tools")
    registry({"broken": {"command": sys.executable, "args": BROKEN}})
    written = [logs.JsonFormatter("vigil-worker").format(r) for r in caplog.records if "offers no" in r.getMessage()]
    [line] = [json.loads(w) for w in written]
    assert line["level"] == "WARNING" and line["logger"] == "vigil.agent.mcp_tools", line
    assert line["msg"].startswith("MCP server broken offers no tools until it can be listed: "), line
    assert "RuntimeError: no database at /srv/orders.db" in line["msg"] and "ExceptionGroup" not in line["msg"], line


def test_a_call_that_loses_its_server_is_tried_once_more_with_the_same_key(call_log):
    tools = {tool.name: tool for tool in registry({"orders": orders(call_log)}).tools}
    result = call(tools["orders__crash_once"], {}, "run-7:3")
    assert not result.is_error and result.text == "done", result.text
    first, second = calls(call_log)
    assert first["tool"] == second["tool"] == "crash_once"
    assert first["meta"]["idempotency_key"] == second["meta"]["idempotency_key"] == "run-7:3"


def tools_list(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vigil", "tools", "list", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_tools_list_needs_no_secret_and_exits_1_naming_why_a_server_failed(call_log):
    env = {
        "PATH": "/usr/bin:/bin",
        "VIGIL_MCP_SERVERS": json.dumps(
            {"orders": orders(call_log), "broken": {"command": sys.executable, "args": BROKEN}}
        ),
    }
    done = tools_list(env, "--json")
    assert done.returncode == 1, done.stderr
    names = [json.loads(line)["name"] for line in done.stdout.splitlines()]
    assert "orders__lookup" in names
    [down] = [line for line in done.stderr.splitlines() if line.startswith("vigil: MCP server broken")]
    assert "RuntimeError: no database at /srv/orders.db" in down and "ExceptionGroup" not in down


def test_tools_list_shows_a_profiles_tools_and_servers(call_log, vigil_env, tmp_path):
    env = {
        **vigil_env,
        "VIGIL_MCP_SERVERS": json.dumps(
            {"orders": orders(call_log), "broken": {"command": sys.executable, "args": BROKEN}}
        ),
    }
    made = subprocess.run(
        [sys.executable, "-m", "vigil", "profiles", "create", "support", "--mcp-server", "orders"]
        + ["--tools", "send_message=allow,orders__lookup=ask", "--allow-unknown"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    # A permission for a tool of a server the profile leaves out is kept, not refused as a
    # typo (the worker keeps it too); a name no configured server can have still is.
    env["VIGIL_TOOL_PERMISSIONS"] = "broken__reset=deny"
    done = tools_list(env, "--json", "--profile", "support")
    assert done.returncode == 0, done.stderr  # the broken server is not the profile's
    rows = {row["name"]: row["permission"] for row in map(json.loads, done.stdout.splitlines())}
    assert rows == {"send_message": "allow", "orders__lookup": "ask"}
    missing = tools_list(env, "--profile", "nobody")
    assert missing.returncode == 1 and "no profile 'nobody'" in missing.stderr
    typo = tools_list({**env, "VIGIL_TOOL_PERMISSIONS": "orders__lookupp=deny"}, "--profile", "support")
    assert typo.returncode == 2 and "no tool named 'orders__lookupp'" in typo.stderr, typo.stderr


class Hanging:
    """A streamable HTTP 'server' that accepts connections and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/mcp"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_hanging_http_server_is_a_tool_error_within_the_timeout():
    hanging = Hanging()
    try:
        settings = t.settings(mcp_timeout_s=2, outbound_allowed_nets=LOOPBACK)
        connection = Connection(McpServer("slowpoke", url=hanging.url), settings, address_policy(settings))
        schema = {"type": "object", "properties": {}}
        tool = McpTool(connection, mcp_types.Tool(name="lookup", input_schema=schema), 1000)

        async def go():
            return await asyncio.wait_for(tool.run({}, CallContext("u1", "toolu_1", "k1")), 20)

        result = asyncio.run(go())
    finally:
        hanging.close()
    assert result.is_error and "did not answer: no answer within 2 s" in result.text, result.text
