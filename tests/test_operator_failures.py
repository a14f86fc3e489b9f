"""Operator commands and service start-ups when something is wrong: one line, a known exit code.

A dependency that is down (a closed port, a PostgreSQL server that was really stopped, a
broker that does not answer) is one line on stderr naming it and exit 3; a service that
cannot start (a port taken, a ledger behind the code) one line and exit 2. Never a traceback.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from vigil.cli import main
from vigil.cliutil import login_name
from vigil_dev import devstack
from vigil_dev.devstack import free_port

# Every command that reads or writes the ledger, as an operator types it.
LEDGER_COMMANDS = [
    ["inbox", "ann"],
    ["dead", "list"],
    ["dead", "retry", "1", "--json"],
    ["outbox", "ann"],
    ["outbox", "--revive", "d-1", "--json"],
    ["tokens", "list", "--json"],
    ["tokens", "revoke", "tok-1", "--json"],
    ["hooks", "list"],
    ["channels", "show", "ann", "--json"],
    ["timers", "list", "ann"],
    ["timers", "rm", "ann", "t1", "--json"],
    ["migrate"],
    ["migrate", "--check", "--json"],
]


def vigil(*args: str, env: dict[str, str] | None = None, timeout: float = 60, module: str = "vigil"):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args", LEDGER_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_ledger_on_a_closed_port_is_one_line_and_exit_3(args):
    closed = f"postgresql://vigil@127.0.0.1:{free_port()}/vigil"
    result = vigil(*args, env={"VIGIL_DATABASE_URL": closed})
    assert_one_line(result, 3, "PostgreSQL", "VIGIL_DATABASE_URL", "refused")
    assert result.stdout == ""


@pytest.mark.slow
@pytest.mark.stack  # starts a PostgreSQL server of its own
def test_ledger_really_stopped_is_one_line_and_exit_3():
    """A PostgreSQL server that ran and was stopped, not a port that never had one."""
    root = Path(tempfile.mkdtemp(prefix="vigil-stopped-pg-"))
    os.chmod(root, 0o755)
    pg = devstack.PostgresServer(root / "data", free_port())
    try:
        pg.start()
        assert vigil("migrate", env={"VIGIL_DATABASE_URL": pg.url()}).returncode == 0
        assert vigil("inbox", "ann", env={"VIGIL_DATABASE_URL": pg.url()}).returncode == 0
        pg.stop()
        for args in (["inbox", "ann"], ["tokens", "list"], ["migrate", "--check"]):
            assert_one_line(vigil(*args, env={"VIGIL_DATABASE_URL": pg.url()}), 3, "PostgreSQL is unreachable")
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_broker_on_a_closed_port_is_one_line_and_exit_3():
    result = vigil("topics", "--timeout", "3", env={"VIGIL_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}"})
    assert_one_line(result, 3, "Kafka is unreachable", "VIGIL_KAFKA_BOOTSTRAP")


def topic_env(stack, **extra: str) -> dict[str, str]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    return {
        "VIGIL_KAFKA_BOOTSTRAP": stack.bootstrap,
        "VIGIL_EVENTS_TOPIC": f"{prefix}.events",
        "VIGIL_DLQ_TOPIC": f"{prefix}.dlq",
        "VIGIL_DELIVERIES_TOPIC": f"{prefix}.deliveries",
        "VIGIL_PARTITIONS": "3",
        **extra,
    }


def test_topics_created_with_the_settings_then_compared(stack):
    env = topic_env(stack, VIGIL_TOPIC_REPLICATION="1")
    first = vigil("topics", "--json", env=env)
    assert first.returncode == 0, first.stderr
    topics = {t["name"]: t for t in json.loads(first.stdout)["topics"]}
    events = topics[env["VIGIL_EVENTS_TOPIC"]]
    assert events["created"] and events["partitions"] == 3 and events["replication"] == 1
    # Replication 1: nothing to wait for beyond the leader. 168 h: the dedup window's default.
    assert events["config"] == {"min.insync.replicas": "1", "retention.ms": str(168 * 3_600_000)}
    assert all(t["differences"] == [] for t in topics.values()), topics

    # The same topics against other settings: nothing is changed, every difference is named.
    changed = {**env, "VIGIL_PARTITIONS": "4", "VIGIL_EVENTS_RETENTION_HOURS": "24"}
    second = vigil("topics", "--json", env=changed)
    assert second.returncode == 0, second.stderr
    topics = {t["name"]: t for t in json.loads(second.stdout)["topics"]}
    events = topics[env["VIGIL_EVENTS_TOPIC"]]
    assert not events["created"] and events["partitions"] == 3
    assert any("3 partitions, settings want 4" in d for d in events["differences"]), events
    assert any(f"retention.ms={168 * 3_600_000}, settings want {24 * 3_600_000}" in d for d in events["differences"])
    assert any("3 partitions" in d for d in topics[env["VIGIL_DLQ_TOPIC"]]["differences"])

    # The default replication (3) against the session's single broker: said, not changed.
    text = vigil("topics", env={**env, "VIGIL_TOPIC_REPLICATION": "3"})
    assert text.returncode == 0, text.stderr
    assert "differs: replication factor 1, settings want 3 (VIGIL_TOPIC_REPLICATION" in text.stdout
    assert "differs: min.insync.replicas=1, settings want 2" in text.stdout


def test_replication_above_the_broker_count_is_one_line(stack):
    env = topic_env(stack, VIGIL_TOPIC_REPLICATION="3")
    result = vigil("topics", env=env)
    line = assert_one_line(result, 2, "VIGIL_TOPIC_REPLICATION=3", "1 broker")
    assert env["VIGIL_EVENTS_TOPIC"] in line
    listed = vigil("topics", "--json", env={**env, "VIGIL_TOPIC_REPLICATION": "1"})
    assert all(t["created"] for t in json.loads(listed.stdout)["topics"])  # nothing was half-created


def test_min_insync_above_replication_is_a_settings_error():
    result = vigil("topics", env={"VIGIL_TOPIC_REPLICATION": "1", "VIGIL_TOPIC_MIN_INSYNC_REPLICAS": "2"})
    assert_one_line(result, 2, "VIGIL_TOPIC_MIN_INSYNC_REPLICAS=2", "VIGIL_TOPIC_REPLICATION=1")


@pytest.fixture
def empty_database(stack):
    name = f"vigil_empty_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        stack.create_database(conn, name)
    try:
        yield stack.dsn(name)
    finally:
        with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_migrate_check_exits_1_while_behind_then_0(empty_database):
    env = {"VIGIL_DATABASE_URL": empty_database}
    behind = vigil("migrate", "--check", "--json", env=env)
    assert behind.returncode == 1, behind.stderr
    report = json.loads(behind.stdout)
    assert report["up_to_date"] is False and report["pending"][0].startswith("0001_")

    applied = vigil("migrate", "--json", env=env)
    assert applied.returncode == 0, applied.stderr
    assert json.loads(applied.stdout)["applied"] == report["pending"]

    after = vigil("migrate", "--check", env=env)
    assert after.returncode == 0 and after.stdout.strip() == "ledger is up to date"


@pytest.mark.parametrize("service", ["scheduler", "dispatcher", "worker"])
def test_service_refuses_a_ledger_behind_the_code(service, empty_database, vigil_env):
    env = {**vigil_env, "VIGIL_DATABASE_URL": empty_database, "VIGIL_AGENT": "echo"}
    assert_one_line(vigil(service, env=env), 2, "cannot start", "schema is behind", "vigil migrate")


@pytest.mark.parametrize(
    ("service", "variable"), [("scheduler", "VIGIL_SCHEDULER_PORT"), ("dispatcher", "VIGIL_DISPATCHER_PORT")]
)
def test_service_port_taken_is_one_line_and_exit_2(service, variable, vigil_env):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = vigil(service, env={**vigil_env, variable: str(port)})
    assert_one_line(result, 2, "cannot start", f"port {port}")


def test_json_on_config():
    result = vigil("config", "--json")
    rows = {row["variable"]: row for row in json.loads(result.stdout)}
    assert rows["VIGIL_TOPIC_REPLICATION"]["default"] == "`3`"
    assert rows["VIGIL_SHUTDOWN_GRACE_S"]["services"] == "worker"


def test_json_on_revoke_rm_and_retry(ledger):
    env = {"VIGIL_DATABASE_URL": ledger}
    token = json.loads(vigil("tokens", "create", "ci", "--json", env=env).stdout)
    revoked = vigil("tokens", "revoke", token["id"], "--json", env=env)
    assert json.loads(revoked.stdout) == {"revoked": token["id"], "name": "ci"}, revoked.stderr

    assert vigil("timers", "add", "ann", "t1", "--due", "2099-01-01T00:00:00Z", env=env).returncode == 0
    removed = vigil("timers", "rm", "ann", "t1", "--json", env=env)
    assert json.loads(removed.stdout) == {"cancelled": "t1", "user_id": "ann"}, removed.stderr

    retried = vigil("dead", "retry", "424242", "--json", env=env)
    assert json.loads(retried.stdout) == {"retried": [], "not_dead": [424242]}, retried.stderr


def test_dev_status_json_names_every_part_and_its_state(tmp_path):
    """`vigil-dev status --json`: one object per part; a pid file whose process is gone is dead."""
    (tmp_path / "pids").mkdir()
    (tmp_path / "pids" / "worker.pid").write_text("999999999")  # no such process
    result = vigil("status", "--json", module="vigil_dev", env={"VIGIL_DEV_RUN_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    parts = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert {"ingest", "worker", "scheduler", "dispatcher", "kafka", "postgresql"} <= set(parts)
    assert parts["worker"] == {"name": "worker", "state": "dead", "pid": None}
    assert parts["ingest"]["state"] == "stopped"


@pytest.mark.parametrize("args", [["dead", "retry", "1"], ["tasks", "cancel", "t-1"]], ids=" ".join)
def test_a_login_without_a_name_is_audited_as_unknown_not_a_traceback(args, monkeypatch):
    """A container running as a numeric user with no passwd entry has no login name, and
    ``getpass`` raises: the commands that audit who ran them fall back to ``unknown``, here
    going on to the closed port's exit 3 (no process of the test's can drop its passwd entry,
    so ``getpass`` is made to raise as it does there)."""

    def nameless() -> str:
        raise OSError("No username set in the environment")

    monkeypatch.setattr(getpass, "getuser", nameless)
    assert login_name() == "unknown"
    closed = f"postgresql://vigil@127.0.0.1:{free_port()}/vigil"
    result = CliRunner().invoke(main, args, env={"VIGIL_DATABASE_URL": closed})
    assert result.exit_code == 3, (result.output, result.exception)
