"""Tool packages: an ordinary Python package with a ``vigil.tools`` entry point, pip-installed
by the test into a directory of its own (on this process's path and on its child processes'
PYTHONPATH, never the shared venv, which every other test's processes would see), is loaded,
listed by ``vigil tools list`` and called by a run; two tools with one name stop start-up
with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vigil.agent.actions import ToolRegistry
from vigil_dev import agent_testing as t
from vigil_dev.scripted_server import ScriptedServer

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

LOOKUP = """
from vigil.agent.settings import Permission
from vigil.agent.tools import ActionTool, ToolOutput


class Lookup(ActionTool):
    name = "{name}"
    description = "Look an order up."
    input_schema = {{"type": "object", "properties": {{"order_id": {{"type": "string"}}}}, "required": ["order_id"]}}
    default_permission = Permission.ALLOW

    async def run(self, args, call):
        return ToolOutput(f"order {{args['order_id']}} shipped (key {{call.idempotency_key}})")


def tool(settings):
    return Lookup()
"""


def build_package(root: Path, dist: str, module: str, tool: str) -> Path:
    """A tool package in ``root``: pyproject.toml with the entry point, and its module."""
    package = root / dist
    (package / module).mkdir(parents=True)
    (package / "pyproject.toml").write_text(
        textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.3.1"

        [project.entry-points."vigil.tools"]
        {tool} = "{module}:tool"

        [tool.setuptools]
        packages = ["{module}"]
        """)
    )
    (package / module / "__init__.py").write_text(LOOKUP.format(name=tool))
    return package


def pip(*args: str) -> None:
    """pip's command line, run by uv where `make install` put it (builds in a second, not ten)."""
    uv = Path(sys.executable).parent / "uv"
    if uv.exists():
        command = [str(uv), "pip", args[0], "--quiet", "--python", sys.executable, *args[1:]]
    else:
        command = [sys.executable, "-m", "pip", "-q", *args]
    subprocess.run(command, check=True, capture_output=True, timeout=240)


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """This test's own site directory: first on this process's path (importlib.metadata reads
    the path at each call) and on the PYTHONPATH of the processes :func:`vigil` starts."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


@pytest.fixture
def installed(tmp_path, site):
    """Install packages into this test's site directory, gone with its tmp_path."""

    def install(dist: str, module: str, tool: str) -> None:
        pip("install", "--no-deps", "--target", str(site), str(build_package(tmp_path, dist, module, tool)))

    yield install
    for module in [m for m in sys.modules if m.startswith("vigil_test_")]:
        del sys.modules[module]


def vigil(*args: str, site: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """``python -m vigil ...``, seeing the packages installed into ``site`` if given."""
    path = [str(REPO / "services"), *([str(site)] if site else [])]
    environ = {**os.environ, "VIGIL_APPROVAL_SECRET": "x", "PYTHONPATH": os.pathsep.join(path), **env}
    return subprocess.run(
        [sys.executable, "-m", "vigil", *args], capture_output=True, text=True, env=environ, timeout=120
    )


def test_an_installed_tool_package_is_loaded_listed_and_called(installed, site):
    installed("vigil-test-lookup-tool", "vigil_test_lookup_tool", "lookup")

    listed = vigil("tools", "list", "--json", site=site)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {"name": "lookup", "source": "vigil-test-lookup-tool", "version": "0.3.1", "permission": "allow"} in rows
    # The demo's refund comes the same way, from its example package.
    assert {"name": "refund", "source": "vigil-refund-tool", "version": "1.0.0", "permission": "ask"} in rows

    reply = [{"type": "tool_use", "name": "send_message", "input": {"text": "{1}"}}]
    script = [
        {"when": {"tool_result": "send_message"}, "reply": []},
        {"when": {"tool_result": "lookup", "tool_result_text": r"(order A17 shipped)"}, "reply": reply},
        {"reply": [{"type": "tool_use", "name": "lookup", "input": {"order_id": "A17"}}]},
    ]
    with ScriptedServer(script) as server:
        # A fresh process would load it at start-up; this one reads the entry points now.
        [result] = t.run(server.base_url, t.context([t.chat("where is A17?")]))
        offered = {tool["name"] for tool in server.requests()[0]["tools"]}
    assert "lookup" in offered
    assert [m.text for m in result.messages] == ["order A17 shipped"]


def test_two_tools_with_one_name_stop_start_up_with_one_line(installed, site, ledger):
    installed("vigil-test-clash-tool", "vigil_test_clash_tool", "refund")

    with pytest.raises(Exception, match="two tools are named 'refund'"):
        ToolRegistry.from_settings(t.settings())
    listed = vigil("tools", "list", site=site)
    # A ledger at this code's schema, so that the worker gets as far as building its agent.
    worker = vigil("worker", site=site, VIGIL_AGENT="claude", ANTHROPIC_API_KEY="offline", VIGIL_DATABASE_URL=ledger)
    for refused in (listed, worker):
        assert refused.returncode == 2, refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1, refused.stderr
        assert "two tools are named 'refund'" in lines[0]
        assert "vigil-refund-tool 1.0.0" in lines[0] and "vigil-test-clash-tool 0.3.1" in lines[0]
    # Every other test's processes (other xdist workers included) see the venv, not this
    # test's site: the clash is this test's alone.
    elsewhere = vigil("tools", "list")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "vigil-test-clash-tool" not in elsewhere.stdout
