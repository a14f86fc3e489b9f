"""A worker whose MCP server is down at start-up: a real `vigil worker` process, the real
stdio test server (tests/mcp_test_server.py) behind a gate that makes it fail until a file
exists, the scripted Messages API. The worker starts and serves runs without the server's
tools; once the server answers, its tools are offered with the permissions
``VIGIL_TOOL_PERMISSIONS`` gave them at start-up (issue 53, item 6)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

from support import REPO, query, wait_for
from vigil_dev.scripted_server import ScriptedServer
from worker_support import chat, claude_env, metric, produce

SERVER = Path(__file__).resolve().parent / "mcp_test_server.py"


def use(name, **tool_input):
    return {"type": "tool_use", "name": name, "input": tool_input}


SCRIPT = [
    {"when": {"tool_result": "send_message"}, "reply": []},
    {"when": {"user_text": "where is"}, "reply": [use("orders__lookup", order_id="A17")]},
    {"reply": [use("send_message", text="hello back")]},
]


def offered(request: dict) -> set[str]:
    return {tool["name"] for tool in request["tools"]}


def outbox(dsn: str, user: str) -> list[str]:
    return [r["body"] for r in query(dsn, "SELECT body FROM outbox WHERE user_id = %s ORDER BY id", (user,))]


def readyz(port: int) -> tuple[int, dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
        return response.status, json.loads(response.read())


def test_a_server_down_at_start_up_offers_its_tools_when_back_with_their_permissions(
    stack, ledger, topics, vigil_env, spawn, tmp_path
):
    up = tmp_path / "server-is-up"
    calls = tmp_path / "calls.jsonl"
    calls.touch()
    # Exits at once (no MCP handshake) until the file exists: a server that fails at start.
    gated = f"test -e {shlex.quote(str(up))} || exit 1; exec {shlex.quote(sys.executable)} {SERVER} stdio {calls}"
    servers = {"orders": {"command": "/bin/sh", "args": ["-c", gated]}}
    with ScriptedServer(SCRIPT) as model:
        env = claude_env(
            vigil_env,
            model.base_url,
            VIGIL_MCP_SERVERS=json.dumps(servers),
            VIGIL_TOOL_PERMISSIONS="orders__cancel_order=deny,orders__lookup=ask",
            VIGIL_MCP_RETRY_S="0.5",
        )
        worker = spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))

        produce(stack.bootstrap, topics.events, [chat("ann", "hello")])
        wait_for(lambda: outbox(ledger, "ann") == ["hello back"], 60, "a reply while the server is down")
        assert not any(name.startswith("orders__") for name in offered(model.requests()[0]))
        port = int(env["VIGIL_WORKER_PORT"])
        status, body = readyz(port)
        assert status == 200 and body["ready"] and "orders" in body["down"], body  # named, not failing
        assert metric(port, "vigil_mcp_server_up", 'server="orders"') == 0

        up.touch()
        wait_for(lambda: "MCP server orders is up" in worker.log(), 30, "the worker to list the server again")
        assert readyz(port)[1]["down"] == {}
        assert metric(port, "vigil_mcp_server_up", 'server="orders"') == 1
        assert metric(port, "vigil_mcp_server_tools", 'server="orders"') >= 4
        model.clear()
        produce(stack.bootstrap, topics.events, [chat("bob", "where is A17?")])
        wait_for(lambda: len(outbox(ledger, "bob")) == 1, 60, "bob's approval question")

        tools = offered(model.requests()[0])
        assert {"orders__lookup", "orders__big", "orders__slow"} <= tools
        assert "orders__cancel_order" not in tools  # deny: never offered
        [approval] = query(ledger, "SELECT tool, answer FROM approvals WHERE user_id = 'bob'")
        assert approval == {"tool": "orders__lookup", "answer": None}  # ask: the person decides
        [run] = query(ledger, "SELECT outcome FROM runs WHERE user_id = 'bob'")
        assert run["outcome"] == "deferred"
        assert calls.read_text() == ""  # nothing ran on the server
        assert worker.alive()


def test_a_permission_for_a_tool_no_configured_server_or_package_has_still_stops_start_up(ledger, vigil_env, tmp_path):
    servers = {"orders": {"command": "/bin/false"}}  # down: its tools may be named, no other
    env = {
        **vigil_env,
        "VIGIL_AGENT": "claude",
        "ANTHROPIC_API_KEY": "offline",
        "VIGIL_MCP_SERVERS": json.dumps(servers),
        "VIGIL_TOOL_PERMISSIONS": "orders__lookup=deny,inventory__restock=deny",
    }
    refused = subprocess.run(
        [sys.executable, "-m", "vigil", "worker"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2, refused.stderr
    assert "VIGIL_TOOL_PERMISSIONS" in refused.stderr and "'inventory__restock'" in refused.stderr
    assert "orders__lookup" not in refused.stderr.splitlines()[-1].split("(tools:")[0]
