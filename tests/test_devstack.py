"""`vigil-dev up` / `down` (what `make up` / `make down` run): real processes, twice is harmless,
and down leaves nothing of the stack running."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

from support import REPO, SERVICE_PORTS, STACK_PORTS, dev_env
from vigil_dev import devstack
from vigil_dev.devstack import http_ok


@pytest.mark.early
@pytest.mark.slow
@pytest.mark.stack  # starts a stack of its own
# Two `up`s, a demo step and a `down` of a whole stack: four minutes on a busy 2-core machine.
@pytest.mark.timeout(600)
def test_dev_up_twice_then_down_leaves_nothing_running():
    root = Path(tempfile.mkdtemp(prefix="vigil-devstack-"))
    os.chmod(root, 0o755)
    ports = {name: devstack.free_port() for name in (*STACK_PORTS, *SERVICE_PORTS)}
    env = dev_env(root, ports)

    def vigil_dev(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "vigil_dev", *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
        )

    try:
        first = vigil_dev("up")
        assert first.returncode == 0, first.stdout + first.stderr
        services = {"ingest", "worker", "scheduler", "dispatcher", "console"}
        for name in ["kafka", "postgresql", "claude", *services, "settings"]:
            assert any(line.startswith(name) for line in first.stdout.splitlines()), (
                f"{name} not reported:\n{first.stdout}"
            )
        pids = {p.name: p.read_text() for p in (root / "pids").glob("*.pid")}
        assert set(pids) == {f"{name}.pid" for name in services} | {"scripted-claude.pid"}
        for variable in [f"VIGIL_{name.upper()}_PORT" for name in services]:
            assert http_ok(f"http://127.0.0.1:{ports[variable]}/readyz"), variable
        settings = (root / "env").read_text()
        assert f"export VIGIL_KAFKA_BOOTSTRAP=127.0.0.1:{ports['VIGIL_DEV_KAFKA_PORT']}" in settings
        assert "VIGIL_API_TOKEN=" in settings and oct((root / "env").stat().st_mode)[-3:] == "600"
        # The services' URL carries the stack's generated password, printed nowhere; the key
        # that seals hook and channel secrets is the stack's own (tests/test_secrets.py).
        password = (root / "pg" / "vigil.password").read_text().strip()
        assert f"VIGIL_DATABASE_URL=postgresql://vigil:{password}@127.0.0.1:" in settings
        assert password not in first.stdout + first.stderr and "vigil:***@" in first.stdout
        assert f"VIGIL_SECRET_KEY={(root / 'secret_key').read_text().strip()}" in settings

        # The dev ports are kept: a shell that sourced .run/env finds this same stack.
        assert f"export VIGIL_DEV_PG_PORT={ports['VIGIL_DEV_PG_PORT']}" in settings
        assert f"export VIGIL_DEV_KAFKA_PORT={ports['VIGIL_DEV_KAFKA_PORT']}" in settings

        # The demo's MCP step against this stack: the worker started the stack's `shop` server
        # (VIGIL_MCP_SERVERS), the model called its tool, the answer was delivered and the
        # ledger's copy of the conversation holds the call and its result.
        stack = dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in settings.splitlines())
        shown = subprocess.run(
            [sys.executable, "-m", "vigil_dev", "demo", "--step", "mcp"],
            env={**env, **{k: v for k, v in stack.items() if k.startswith("VIGIL_")}},
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        answer = r"order 42: shipped by (parcel post|courier|freight), tracking VG-\d{5}"
        assert re.search(r"agent: The shop says \(MCP server shop\): " + answer, shown.stdout), shown.stdout
        assert re.search(
            r"ledger: session \S+ holds the call shop__order_status\(\{\"order_id\": \"42\"\}\) -> '" + answer,
            shown.stdout,
        ), shown.stdout
        assert "demo: ok" in shown.stdout and "4. a follow-up" not in shown.stdout

        again = vigil_dev("up", "--demo")
        assert again.returncode == 0, again.stderr
        assert {p.name: p.read_text() for p in (root / "pids").glob("*.pid")} == pids, "a second up restarted something"
        assert "demo        not run again" in again.stdout  # `make up` on a running stack

        # A killed service is reported dead at once (even before its zombie is reaped), and
        # the next up brings it back.
        os.kill(int(pids["ingest.pid"]), signal.SIGKILL)
        devstack.wait_until(lambda: not devstack.pid_alive(int(pids["ingest.pid"])), 10, "ingest gone")
        status = vigil_dev("status").stdout
        assert re.search(r"^ingest\s+dead", status, re.MULTILINE), status
        assert re.search(r"^worker\s+running pid", status, re.MULTILINE), status
        assert vigil_dev("up").returncode == 0
        assert (root / "pids" / "ingest.pid").read_text() != pids["ingest.pid"]
        pids["ingest.pid"] = (root / "pids" / "ingest.pid").read_text()

        all_pids = [int(v) for v in pids.values()]
        all_pids.append(int((root / "kafka" / "data" / "kafka.pid").read_text()))
        all_pids.append(int((root / "pg" / "postgres.pid").read_text()))
        down = vigil_dev("down")
        assert down.returncode == 0, down.stderr
        assert "kafka" in down.stdout and "postgresql" in down.stdout
        alive = [pid for pid in all_pids if devstack.pid_alive(pid)]
        assert not alive, f"still running after down: {alive}"
        for port in ports.values():
            assert not devstack.port_open(port), f"port {port} still open"
    finally:
        vigil_dev("down")
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.stack  # starts a stack of its own
def test_dev_up_with_two_shards_starts_a_second_postgresql_and_down_stops_both():
    root = Path(tempfile.mkdtemp(prefix="vigil-devstack-shards-"))
    os.chmod(root, 0o755)
    ports = {name: devstack.free_port() for name in STACK_PORTS}
    shard_port = devstack.free_port()
    env = {**dev_env(root, ports), "VIGIL_DEV_SHARDS": "2", "VIGIL_DEV_PG_SHARD_PORTS": str(shard_port)}

    def run(*args: str, extra: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", *args], env={**env, **(extra or {})}, capture_output=True, text=True, timeout=300
        )

    try:
        up = run("vigil_dev", "up", "--no-services")
        assert up.returncode == 0, up.stdout + up.stderr
        assert re.search(rf"^shard 1\s+postgresql://vigil:\*\*\*@127.0.0.1:{shard_port}/vigil", up.stdout, re.M), (
            up.stdout
        )
        settings = dict(
            line.removeprefix("export ").split("=", 1) for line in (root / "env").read_text().splitlines()[1:]
        )
        # The second server has its own passwords, the same authentication and the same role.
        first, second = (
            (root / "pg" / "vigil.password").read_text().strip(),
            (root / "pg1" / "vigil.password").read_text().strip(),
        )
        assert first != second and second not in up.stdout
        assert settings["VIGIL_LEDGER_SHARDS"] == (
            f"postgresql://vigil:{first}@127.0.0.1:{ports['VIGIL_DEV_PG_PORT']}/vigil,"
            f"postgresql://vigil:{second}@127.0.0.1:{shard_port}/vigil"
        )
        assert settings["VIGIL_DEV_SHARDS"] == "2" and settings["VIGIL_DEV_PG_SHARD_PORTS"] == str(shard_port)
        shard_url = settings["VIGIL_LEDGER_SHARDS"].split(",")[1]
        with psycopg.connect(shard_url) as conn:
            assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone() == (False,)
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(shard_url.replace(second, "wrong")).close()

        # `vigil migrate` ran on both: `vigil shards` with the stack's settings lists two.
        listed = run("vigil", "shards", "--json", extra=settings)
        assert listed.returncode == 0, listed.stderr
        shards = json.loads(listed.stdout)["shards"]
        assert [(s["shard"], s["reachable"], s["pending"]) for s in shards] == [(0, True, []), (1, True, [])]
        assert shards[1]["partitions"] == list(range(1, 12, 2))

        pids = [int((root / name / "postgres.pid").read_text()) for name in ("pg", "pg1")]
        assert "postgresql-1" in run("vigil_dev", "status").stdout
        down = run("vigil_dev", "down")
        assert down.returncode == 0, down.stderr
        assert "postgresql, postgresql-1" in down.stdout
        assert not [pid for pid in pids if devstack.pid_alive(pid)]
        assert not devstack.port_open(shard_port) and not devstack.port_open(ports["VIGIL_DEV_PG_PORT"])
    finally:
        run("vigil_dev", "down")
        shutil.rmtree(root, ignore_errors=True)


def test_dev_up_help_names_every_service_it_starts():
    from click.testing import CliRunner

    from vigil_dev.cli import SERVICES, main

    text = " ".join(CliRunner().invoke(main, ["up", "--help"]).output.split())
    assert "four" not in text
    for name in SERVICES:
        assert name in text, f"`vigil-dev up --help` does not name the {name} service: {text}"
    counts = {4: "four", 5: "five", 6: "six", 7: "seven"}
    [make_up] = [line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("up:")]
    assert f"the {counts[len(SERVICES)]} services" in make_up, f"`make help` counts the services wrong: {make_up}"


def test_dev_up_keeps_the_otel_settings_in_its_env_file(tmp_path, monkeypatch):
    from vigil_dev.cli import _stack_env

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "vigil-dev-test")
    env = _stack_env(tmp_path)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4318", "a restart from .run/env exports nothing"
    assert env["OTEL_SERVICE_NAME"] == "vigil-dev-test"


def test_dev_up_refuses_a_bad_script_before_starting_anything(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from vigil_dev.cli import main

    root = tmp_path / "run"
    monkeypatch.setenv("VIGIL_DEV_RUN_DIR", str(root))
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    bad = tmp_path / "mine.json"
    bad.write_text(json.dumps({"rules": [{"when": {"user_txt": "refund"}, "reply": []}]}))
    result = CliRunner().invoke(main, ["up", "--script", str(bad)])
    assert result.exit_code == 1, result.output
    assert str(bad) in result.output and "user_txt" in result.output, result.output
    assert not root.exists(), "a bad script must be refused before Kafka, PostgreSQL or a service starts"
    missing = CliRunner().invoke(main, ["up", "--script", str(tmp_path / "none.json")])
    assert missing.exit_code == 1 and "none.json" in missing.output and "No such file" in missing.output


def test_the_scripted_model_answers_from_the_authors_script_and_takes_a_new_one_when_running(tmp_path, monkeypatch):
    import httpx

    from vigil_dev.cli import _start_scripted_claude

    port = devstack.free_port()
    monkeypatch.setenv("VIGIL_DEV_CLAUDE_PORT", str(port))
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps({"rules": [{"name": "mine", "reply": [{"type": "text", "text": "one"}]}]}))
    second.write_text(json.dumps({"rules": [{"name": "later", "reply": []}]}))
    (tmp_path / "pids").mkdir()
    (tmp_path / "logs").mkdir()
    try:
        env = _start_scripted_claude(tmp_path, dict(os.environ), first, replace=True)
        assert env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{env['ANTHROPIC_BASE_URL']}/_script").json()["rules"][0]["name"] == "mine"
        _start_scripted_claude(tmp_path, dict(os.environ), second, replace=True)  # already running: PUT /_script
        assert httpx.get(f"{env['ANTHROPIC_BASE_URL']}/_script").json()["rules"][0]["name"] == "later"
    finally:
        devstack.stop(tmp_path / "pids" / "scripted-claude.pid")


def test_make_demo_and_logs_find_a_stack_in_its_own_run_dir(tmp_path):
    """`make up` honours VIGIL_DEV_RUN_DIR; the targets that read the stack's env file and logs
    must look there too, not in .run/."""
    env = {**os.environ, "VIGIL_DEV_RUN_DIR": str(tmp_path / "run")}
    out = subprocess.run(["make", "-n", "demo", "logs"], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert f". {tmp_path}/run/env" in out.stdout, out.stdout
    assert f"{tmp_path}/run/logs/*.log" in out.stdout, out.stdout
