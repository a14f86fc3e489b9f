"""The vigil processes a workload runs: ``python -m vigil worker`` and ``python -m vigil ingest``.

Each is a real subprocess with its settings in ``VIGIL_*`` variables, its log in a file
(printed when it dies), and its own health port, from which the bench reads ``/metrics``.
The bench stops exactly the processes it started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vigil_dev.bench.stack import BenchStack, Topics
from vigil_dev.devstack import free_port

APPROVAL_SECRET = "bench-approval-secret"  # a throwaway key: the bench's tokens never leave its databases
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class ServiceDied(Exception):
    pass


@dataclass
class Service:
    name: str
    args: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> Service:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vigil", *self.args],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            raise ServiceDied(
                f"{self.name} exited ({self.proc.returncode if self.proc else '?'}):\n{self.log()[-3000:]}"
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 2.0) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as response:
                return response.read().decode()
        except OSError:
            return None

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> Service:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            if self.get("/healthz", 1.0) is not None:
                return self
            time.sleep(0.1)
        raise ServiceDied(f"{self.name} not healthy within {timeout:.0f}s:\n{self.log()[-3000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a metric's samples whose labels contain ``labels`` (0 when absent)."""
        text = self.get("/metrics")
        if text is None:
            self.check()
            return 0.0
        total = 0.0
        pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.e+-]+)$", re.MULTILINE)
        for match in pattern.finditer(text):
            if labels in (match.group(1) or ""):
                total += float(match.group(2))
        return total

    def rss_mb(self) -> float:
        """Resident memory of the process now, from /proc (Linux)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        if self.proc is None or not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def base_env(stack: BenchStack, dsn: str, topics: Topics) -> dict[str, str]:
    """The caller's environment (VIGIL_KAFKA_OPT_* and the like pass through) pointed at the
    workload's own database and topics."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_ECHO_")}
    # A two-shard dev stack's shell names its shards: a workload names its own (bench/shards.py).
    env.pop("VIGIL_LEDGER_SHARDS", None)
    env.update(
        {
            "VIGIL_KAFKA_BOOTSTRAP": stack.bootstrap,
            "VIGIL_DATABASE_URL": dsn,
            "VIGIL_EVENTS_TOPIC": topics.events,
            "VIGIL_DLQ_TOPIC": topics.dlq,
            "VIGIL_DELIVERIES_TOPIC": topics.deliveries,
            "VIGIL_PARTITIONS": str(topics.partitions),
            "VIGIL_APPROVAL_SECRET": APPROVAL_SECRET,
            "VIGIL_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class Workers:
    """``count`` worker processes of one consumer group, started and stopped together."""

    def __init__(self, stack: BenchStack, dsn: str, topics: Topics, count: int = 1, **settings: str):
        self.stack = stack
        self.dsn = dsn
        self.topics = topics
        self.group = f"{topics.events}.workers"
        self.settings = settings
        self.procs: list[Service] = []
        for _ in range(count):
            self.add()

    def add(self) -> Service:
        port = free_port()
        env = base_env(self.stack, self.dsn, self.topics)
        env.update(
            {"VIGIL_AGENT": "echo", "VIGIL_WORKER_GROUP": self.group, "VIGIL_WORKER_PORT": str(port), **self.settings}
        )
        index = len(self.procs)
        service = Service(
            f"worker-{index}", ["worker"], env, port, self.stack.workdir / f"{self.topics.events}-worker-{index}.log"
        )
        self.procs.append(service.start())
        return service

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Workers:
        """Healthy, and every partition held by exactly one of them (the group settled)."""
        for proc in self.procs:
            proc.wait_healthy(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = [proc.metric("vigil_partition_epochs_held") for proc in self.procs]
            if sum(held) == self.topics.partitions and all(h > 0 for h in held):
                return self
            time.sleep(0.1)
        raise ServiceDied(f"partitions not assigned within {timeout:.0f}s: {held}\n{self.procs[0].log()[-2000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        return sum(proc.metric(name, labels) for proc in self.procs)

    def check(self) -> None:
        for proc in self.procs:
            proc.check()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
