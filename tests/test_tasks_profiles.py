"""A background task runs with its delegating run's profile version (docs/agent.md,
"Profiles"): a real worker process with the Claude agent, the real SDK talking to the
scripted Messages API, a profile made with `vigil profiles` in the real ledger."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import query, wait_for
from vigil_dev.devstack import free_port
from vigil_dev.scripted_server import ScriptedServer
from worker_support import FAST, chat, produce

DEPLOYMENT_MODEL = "claude-scripted-1"
SCRIPT = {
    "rules": [
        {"when": {"system": "sub-agent"}, "reply": [{"type": "text", "text": "The moon is far."}]},
        {"when": {"user_text": r"kind\W+task\.succeeded"}, "reply": []},
        {"when": {"tool_result": "delegate"}, "reply": []},
        {
            "when": {"user_text": "research the moon"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "delegate",
                    "input": {"instructions": "Research the moon.", "mode": "background", "tools": ["refund"]},
                }
            ],
        },
    ]
}


@pytest.fixture
def claude():
    """Requested before ``spawn``, so it stops after the worker that talks to it."""
    with ScriptedServer(SCRIPT) as server:
        yield server


def profiles(ledger: str, *args: str) -> None:
    env = {**os.environ, "VIGIL_DATABASE_URL": ledger}
    done = subprocess.run([sys.executable, "-m", "vigil", "profiles", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_background_task_runs_with_its_parents_profile_version(claude, stack, topics, ledger, vigil_env, spawn):
    """The profile `research` (its own model; refund allowed, which the deployment asks for) is
    the delegating run's: the task's row records version 1, and the sub-agent's model requests
    carry the profile's model and are offered refund. With the deployment's settings they
    would carry claude-scripted-1 and no tool (a task gets only tools allowed where it runs)."""
    profiles(
        ledger,
        "create",
        "research",
        "--model",
        "claude-research",
        "--tools",
        "send_message=allow,delegate=allow,refund=allow",
    )
    profiles(ledger, "assign", "team-r/*", "research")
    port = free_port()
    env = {
        **vigil_env,
        **FAST,
        "VIGIL_AGENT": "claude",
        "ANTHROPIC_BASE_URL": claude.base_url,
        "ANTHROPIC_API_KEY": "scripted-test-key",
        "VIGIL_MODEL": DEPLOYMENT_MODEL,
        "VIGIL_MODEL_BACKOFF_S": "0.05",
        "VIGIL_WORKER_PORT": str(port),
    }
    spawn(["worker"], env, name="w").wait_healthy(port)
    produce(stack.bootstrap, topics.events, [chat("team-r/rita", "please research the moon")])
    wait_for(
        lambda: [r["status"] for r in query(ledger, "SELECT status FROM tasks")] == ["succeeded"],
        60,
        "the task to succeed",
    )
    [task] = query(ledger, "SELECT profile, profile_version, tools, result FROM tasks")
    assert task == {"profile": "research", "profile_version": 1, "tools": ["refund"], "result": "The moon is far."}
    children = [r for r in claude.requests() if "sub-agent" in str(r.get("system"))]
    assert children, "no sub-agent request reached the model"
    assert {r["model"] for r in children} == {"claude-research"}
    assert [[tool["name"] for tool in r.get("tools", []) if tool["name"] != "delegate"] for r in children] == [
        ["refund"]
    ]
    parents = [r for r in claude.requests() if "sub-agent" not in str(r.get("system"))]
    assert {r["model"] for r in parents} == {"claude-research"}
