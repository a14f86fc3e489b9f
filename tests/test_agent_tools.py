"""The agent's tools: memory confined to /memories, http_request with credentials the model
never sees, permissions (deny, auto mode and its fallback to asking), and settings that
refuse to start naming the variable."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from support import LocalHTTPServer
from vigil.agent.claude import ClaudeAgent
from vigil.agent.memory import Limits, MemoryFiles, MemoryRefused
from vigil.agent.settings import AgentSettings
from vigil.ledger.states import RunOutcome, SessionState
from vigil.settings import SettingsError, load
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

SECRET = "sk-live-7f3a9c1e-never-show-me"


@pytest.fixture(scope="module")
def server():
    with ScriptedServer([]) as s:
        yield s


def run(server, rules, *ctxs, **overrides):
    server.set_script(rules)
    server.clear()
    return t.run(server.base_url, *ctxs, **overrides)


def call(name, **tool_input):
    return {"type": "tool_use", "name": name, "input": tool_input}


def last_results(server):
    return [b for b in server.requests()[-1]["messages"][-1]["content"] if b["type"] == "tool_result"]


# ---------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    "path",
    [
        "/memories/../etc/passwd",
        "/etc/passwd",
        "memories/notes.md",
        "/memories/a/./b.md",
        "/memories//x",
        "/memoriesX/notes.md",
        "/memories/notes..md",
    ],
)
def test_memory_paths_outside_memories_are_refused(path):
    files = MemoryFiles({}, Limits(1000, 10_000, 10))
    with pytest.raises(MemoryRefused):
        files.execute({"command": "create", "path": path, "file_text": "x"})
    assert files.files == {} and files.writes() == []


def test_memory_traversal_through_the_model_is_refused_readably(server):
    [result] = run(
        server,
        [
            {"when": {"tool_result": "memory"}, "reply": []},
            {
                "reply": [
                    call("memory", command="create", path="/memories/../../etc/cron.d/x", file_text="* * * * * evil"),
                    call("memory", command="view", path="/etc/shadow"),
                    call("memory", command="rename", old_path="/memories/notes.md", new_path="/tmp/notes.md"),
                ]
            },
        ],
        t.context([t.chat("hi")], memory={"/memories/notes.md": "mine"}),
    )

    texts = [r["content"] for r in last_results(server)]
    assert all(r.get("is_error") for r in last_results(server))
    assert "'..'" in texts[0] and "outside /memories" in texts[1] and "outside /memories" in texts[2]
    assert result.memory_writes == []


def test_memory_limits_and_commands():
    files = MemoryFiles({"/memories/a.md": "one\ntwo"}, Limits(file_bytes=20, total_bytes=30, max_files=3))
    with pytest.raises(MemoryRefused, match="limit is 20 bytes per file"):
        files.execute({"command": "create", "path": "/memories/big.md", "file_text": "x" * 21})
    files.execute({"command": "insert", "path": "/memories/a.md", "insert_line": 1, "insert_text": "1.5"})
    files.execute({"command": "str_replace", "path": "/memories/a.md", "old_str": "two", "new_str": "2"})
    files.execute({"command": "rename", "old_path": "/memories/a.md", "new_path": "/memories/dir/a.md"})
    files.execute({"command": "create", "path": "/memories/b.md", "file_text": "x" * 15})
    with pytest.raises(MemoryRefused, match="Memory would hold"):
        files.execute({"command": "create", "path": "/memories/c.md", "file_text": "x" * 10})
    with pytest.raises(MemoryRefused, match="is a file"):
        files.execute({"command": "create", "path": "/memories/b.md/c.md", "file_text": "x"})
    assert "     2\t1.5" in files.execute({"command": "view", "path": "/memories/dir/a.md", "view_range": [2, -1]})
    assert "/memories/dir/a.md" in files.execute({"command": "view", "path": "/memories"})
    files.execute({"command": "delete", "path": "/memories/dir"})
    assert [(w.path, w.content) for w in files.writes()] == [("/memories/b.md", "x" * 15), ("/memories/a.md", None)]


# ---------------------------------------------------------------------------- http_request


class _Echo(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def _answer(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        record = {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
        _Echo.seen.append(record)
        data = json.dumps(record).encode()  # echoes every header back, the credential included
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def echo():
    _Echo.seen = []
    httpd = LocalHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


# Error on a warning: with the SDK's logger at DEBUG, its dump of the request options must not
# meet a value of another type than it declares (vigil.agent.model._url).
@pytest.mark.filterwarnings("error::UserWarning")
def test_a_credential_reaches_the_host_but_never_the_model(server, echo, monkeypatch, caplog):
    monkeypatch.setenv("VIGIL_CREDENTIAL_BILLING", SECRET)
    caplog.set_level(logging.DEBUG)
    [result] = run(
        server,
        [
            {"when": {"tool_result": "send_message"}, "reply": []},
            {
                "when": {"tool_result": "http_request"},
                "reply": [
                    call("send_message", text="Balance fetched."),
                    call("memory", command="create", path="/memories/last.md", file_text="checked balance"),
                ],
            },
            {"reply": [call("http_request", method="GET", url=f"{echo}/balance", credential="billing")]},
        ],
        t.context([t.chat("what is my balance?")]),
        http_allowed_hosts="127.0.0.1",
    )

    [received] = _Echo.seen
    assert received["headers"]["Authorization"] == f"Bearer {SECRET}"
    bodies = json.dumps(server.requests())
    assert SECRET not in bodies
    assert "[credential billing]" in bodies  # the echoed header reached the model redacted
    assert "billing" in json.dumps(server.requests()[0]["tools"])  # the model knows the name only
    everything = json.dumps(
        [
            result.session.messages,
            [m.text for m in result.messages],
            [(w.path, w.content) for w in result.memory_writes],
        ]
    )
    assert SECRET not in everything and SECRET not in caplog.text
    assert result.messages[0].text == "Balance fetched."


@pytest.mark.parametrize(
    "tool_input, reason",
    [
        ({"method": "GET", "url": "https://example.org/"}, "not on the allow-list"),
        (
            {"method": "GET", "url": "http://127.0.0.1:1/", "headers": {"Authorization": "Bearer guess"}},
            "may not be set by hand",
        ),
        ({"method": "GET", "url": "http://127.0.0.1:1/", "credential": "nope"}, "no credential named"),
        ({"method": "GET", "url": "file:///etc/passwd"}, "only http and https"),
    ],
)
def test_http_requests_outside_the_rules_are_refused(server, tool_input, reason):
    run(
        server,
        [{"when": {"tool_result": "http_request"}, "reply": []}, {"reply": [call("http_request", **tool_input)]}],
        t.context([t.chat("go")]),
        http_allowed_hosts="127.0.0.1",
    )
    [refusal] = last_results(server)
    assert refusal["is_error"] and reason in refusal["content"]


# ---------------------------------------------------------------------------- permissions


def test_auto_mode_blocks_risky_calls_then_falls_back_to_asking(server, echo):
    post = call("http_request", method="POST", url=f"{echo}/transfer", body="{}")
    [result] = run(
        server,
        [
            {"when": {"tool_result": "http_request", "tool_result_error": True}, "reply": [post]},
            {"reply": [post]},
        ],
        t.context([t.chat("move the money")]),
        http_allowed_hosts="127.0.0.1",
    )

    blocked = [
        r
        for req in server.requests()
        for m in req["messages"]
        if m["role"] == "user"
        for r in m["content"]
        if isinstance(r, dict) and "Blocked by the safety policy" in str(r.get("content"))
    ]
    assert len({b["tool_use_id"] for b in blocked}) == 3
    assert "now need the person's approval" in server.requests()[-1]["messages"][-1]["content"][0]["content"]
    assert result.outcome is RunOutcome.DEFERRED and result.approvals[0].tool == "http_request"
    assert (result.session.blocks, result.session.consecutive_blocks) == (3, 3)
    assert result.session.state == SessionState.WAITING
    assert _Echo.seen == []  # nothing was sent


def test_auto_mode_lets_safe_calls_through(server, echo):
    [result] = run(
        server,
        [
            {"when": {"tool_result": "http_request"}, "reply": []},
            {"reply": [call("http_request", method="GET", url=f"{echo}/status")]},
        ],
        t.context([t.chat("status?")]),
        http_allowed_hosts="127.0.0.1",
    )
    assert len(_Echo.seen) == 1 and result.outcome is RunOutcome.NOTHING
    assert result.session.consecutive_blocks == 0


def test_a_denied_tool_is_not_offered(server):
    run(server, [{"reply": []}], t.context([t.chat("hi")]), tool_permissions="refund=deny,set_followup=deny")
    assert [tool["name"] for tool in server.requests()[0]["tools"]] == [
        "send_message",
        "memory",
        "delegate",
        "tasks_list",
        "task_result",
        "task_cancel",
    ]


def test_a_refused_call_has_its_decision_on_its_span(server, exporter):
    """A call refused before anything ran says why, apart from a tool that answered with an
    error: ``refused`` for arguments the tool's own check refuses; ``deny`` for a tool its
    permission denies, which a model asks for only in a replay of a turn it answered before the
    deployment denied the tool (a model is not offered a denied tool)."""
    from dataclasses import replace

    from opentelemetry.trace import StatusCode

    from test_journal import Recording
    from vigil.agent.journal import Journal

    rules = [
        {"when": {"tool_result": "http_request"}, "reply": []},
        {"reply": [call("http_request", method="GET", url="https://example.org/")]},
    ]
    ctx = t.context([t.chat("go")])
    first = Recording()
    run(server, rules, replace(ctx, journal=Journal(ctx.run_key, first)), http_allowed_hosts="127.0.0.1")
    answered = [s for s in first.steps() if s.step == 1]  # the model's answer: the call
    run(
        server,
        rules,
        replace(ctx, journal=Journal.of(ctx.run_key, None, answered)),
        http_allowed_hosts="127.0.0.1",
        tool_permissions="http_request=deny",
    )
    refused, denied = [s for s in exporter.get_finished_spans() if s.name == "execute_tool http_request"]
    assert (refused.attributes.get("vigil.tool.decision"), refused.attributes.get("error.type")) == (
        "refused",
        "refused",
    )
    assert (denied.attributes.get("vigil.tool.decision"), denied.attributes.get("error.type")) == ("deny", "denied")
    assert refused.status.status_code is denied.status.status_code is StatusCode.ERROR


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "variable, value, named",
    [
        ("VIGIL_TOOL_PERMISSIONS", "refund=sometimes", "VIGIL_TOOL_PERMISSIONS"),
        ("VIGIL_EVENT_POLICIES", "chat=later", "VIGIL_EVENT_POLICIES"),
        ("VIGIL_HTTP_ALLOWED_HOSTS", "not a host", "VIGIL_HTTP_ALLOWED_HOSTS"),
        ("VIGIL_CREDENTIAL_GITHUB_HOSTS", "api.github.com", "VIGIL_CREDENTIAL_GITHUB_HOSTS"),
        ("VIGIL_MAX_TURNS", "0", "VIGIL_MAX_TURNS"),
        ("VIGIL_INSTRUCTIONS_PATH", "/memories/../etc/motd", "VIGIL_INSTRUCTIONS_PATH"),
    ],
)
def test_bad_agent_settings_name_the_variable(monkeypatch, variable, value, named):
    monkeypatch.setenv("VIGIL_APPROVAL_SECRET", "s")
    monkeypatch.setenv("VIGIL_CREDENTIAL_GITHUB", SECRET)
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as raised:
        load(AgentSettings)
    assert named in str(raised.value) and SECRET not in str(raised.value)


@pytest.mark.parametrize("permissions, named", [("teleport=allow", "no tool named"), ("memory=ask", "built in")])
def test_permissions_for_unknown_or_builtin_tools_are_refused(permissions, named):
    with pytest.raises(SettingsError, match=named):
        ClaudeAgent(t.settings(tool_permissions=permissions))


def test_the_agent_refuses_to_start_without_an_api_key(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    with pytest.raises(SettingsError, match="ANTHROPIC_API_KEY"):
        ClaudeAgent.from_environment()
