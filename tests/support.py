"""Helpers for tests that run real processes against the real broker and database."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from vigil_dev import broker
from vigil_dev.devstack import http_ok

REPO = Path(__file__).resolve().parent.parent

# The ports of a `vigil-dev up` stack of a test's own (tests/test_devstack.py, test_secure_stack.py).
STACK_PORTS = ("VIGIL_DEV_KAFKA_PORT", "VIGIL_DEV_KAFKA_CONTROLLER_PORT", "VIGIL_DEV_PG_PORT", "VIGIL_DEV_CLAUDE_PORT")
SERVICE_PORTS = (
    "VIGIL_INGEST_PORT",
    "VIGIL_WORKER_PORT",
    "VIGIL_SCHEDULER_PORT",
    "VIGIL_DISPATCHER_PORT",
    "VIGIL_CONSOLE_PORT",
)


def dev_env(root: Path, ports: dict[str, int]) -> dict[str, str]:
    """What `vigil-dev` is run with: a stack of its own under ``root`` on ``ports``."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        # A checkout run with PYTHONPATH (a worktree beside an editable install) runs its own code.
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
        "VIGIL_DEV_RUN_DIR": str(root),
        "VIGIL_DEV_KAFKA_LIBS": str(broker.kafka_libs(REPO / ".run" / "kafka")),
        **{k: str(v) for k, v in ports.items()},
    }


def stack_settings(env_file: Path) -> dict[str, str]:
    """The settings `vigil-dev up` wrote to ``env_file`` (``.run/env``), as a shell that sourced it has them."""
    lines = [line.removeprefix("export ") for line in env_file.read_text().splitlines() if "=" in line]
    return dict(shlex.split(line)[0].split("=", 1) for line in lines if not line.startswith("PATH="))


class LocalHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server on 127.0.0.1 for a test's fake peer. socketserver listens with
    a backlog of 5: when more clients connect at once (two dispatchers of 8 sends each), the
    kernel's full accept queue turns into connection resets the client counts as a failed
    attempt, which a test on a frozen clock never retries. A deep backlog keeps the peer a
    well-behaved server."""

    request_queue_size = 1024
    daemon_threads = True


def wait_for(
    condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition", interval: float = 0.05
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last value: {last!r})")


def query(dsn: str, sql: str, params: Any = None) -> list[dict]:
    with psycopg.connect(dsn, row_factory=dict_row, autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def explaining(ledger: str) -> str:
    """``ledger`` as the stack's admin role: loading auto_explain and setting its parameters
    take a superuser, and the services' role is not one (the conftest names the admin's DSN)."""
    admin = os.environ.get("VIGIL_TEST_ADMIN_DSN")
    if not admin:
        return ledger
    return psycopg.conninfo.make_conninfo(admin, dbname=psycopg.conninfo.conninfo_to_dict(ledger)["dbname"])


def auto_explain(plan_cache_mode: str, plans: list[dict]) -> tuple[list[str], Callable]:
    """The settings that make a connection report every statement's executed plan
    (auto_explain, as JSON, with row counts), and the notice handler that appends each plan
    to ``plans``."""

    def keep(diag) -> None:
        text = diag.message_primary or ""
        if "plan:" in text:
            plans.append(json.loads(text.split("plan:", 1)[1]))

    settings = [
        "LOAD 'auto_explain'",
        "SET auto_explain.log_min_duration = 0",
        "SET auto_explain.log_analyze = on",
        "SET auto_explain.log_timing = off",
        "SET auto_explain.log_format = json",
        "SET client_min_messages = log",
        f"SET plan_cache_mode = {plan_cache_mode}",
    ]
    return settings, keep


def scalar(dsn: str, sql: str, params: Any = None) -> Any:
    rows = query(dsn, sql, params)
    return next(iter(rows[0].values())) if rows else None


@dataclass
class VigilProcess:
    """A ``vigil <args>`` subprocess with its log in a file; killed at test teardown."""

    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    history: list[str] = field(default_factory=list)

    def start(self) -> VigilProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vigil", *self.args],
            env={**os.environ, **self.env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
        )
        out.close()
        self.history.append(f"start pid {self.proc.pid}")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.history.append(f"signal {signal.Signals(sig).name}")
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up, as in a machine or OOM kill."""
        if self.alive():
            self.signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            # A stopped process cannot act on SIGTERM.
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, port: int, timeout: float = 60.0) -> VigilProcess:
        # A ceiling, not a wait: a start is 3-5 s of CPU, and CI's 2 cores read a worker's past 30 s
        # under the parallel phase's load (7 December).
        def healthy() -> bool:
            if not self.alive():
                raise AssertionError(f"vigil {' '.join(self.args)} exited:\n{self.log()[-3000:]}")
            return http_ok(f"http://127.0.0.1:{port}/healthz")

        wait_for(healthy, timeout, f"vigil {' '.join(self.args)} health on :{port}")
        return self


class UnknownKeys:
    """A miss guard's counter (``vigil_<service>_unknown_keys_total``) before and after a flood
    of made-up keys: :meth:`assert_guarded` says every one was counted, and that past the
    budget they were answered from the set of known keys, not one query each."""

    def __init__(self, service: str, *kinds: str):
        self.metric = f"vigil_{service}_unknown_keys_total"
        self.kinds = kinds
        self.before = {(k, q): self.value(k, q) for k in kinds for q in ("true", "false")}

    def value(self, kind: str, looked_up: str) -> float:
        from prometheus_client import REGISTRY

        return REGISTRY.get_sample_value(self.metric, {"kind": kind, "looked_up": looked_up}) or 0.0

    def assert_guarded(self, flood: int) -> None:
        for kind in self.kinds:
            looked_up = self.value(kind, "true") - self.before[(kind, "true")]
            from_set = self.value(kind, "false") - self.before[(kind, "false")]
            assert looked_up + from_set == flood, (kind, looked_up, from_set)
            assert from_set > 0 and looked_up < flood, (kind, looked_up)
