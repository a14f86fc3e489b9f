"""The rolling-deploy workload: every worker replaced while model-bound runs are in flight.

Two workers run the Claude agent against the scripted Messages API; every user has one chat
message, and each run takes three slow steps (a memory look, a message, done: three model
answers of ``delay_s`` +/- ``spread_s`` each). Once the slots are full, the workers are
replaced one at a time as a deploy does: a new one joins (the group moves partitions to it:
a revoke on the old one), then the old one gets SIGTERM (its drain). Done once per
``VIGIL_HANDOVER`` choice (docs/worker.md, "Durable runs"):

- ``step``: a revoked or stopping worker stops each run at its next step boundary (its
  answer in flight journaled first) and releases it; the next owner replays the journal;
- ``finish``: each run may go on to its finish within the grace (``VIGIL_REVOKE_GRACE_S``,
  ``VIGIL_SHUTDOWN_GRACE_S``); what is still running then is cancelled and replayed.

Figures, per choice (no targets):

- ``rolling_<choice>_model_calls_per_run``: model calls the scripted server answered or was
  cut off in (it records every request) per run; three is none paid twice;
- ``rolling_<choice>_drain_s``: SIGTERM to exit of each old worker;
- ``rolling_<choice>_took_s``: the first join to the last run's finish;
- ``rolling_<choice>_replayed_runs``: runs taken up from their journal by another worker.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass

import psycopg
from psycopg.rows import dict_row

from vigil_dev.bench import load
from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.model_bound import M, ScriptedServers, claude_worker
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.procs import START_TIMEOUT_S, ServiceDied
from vigil_dev.bench.stack import BenchStack

CHOICES = ("step", "finish")
FIGURES = [
    f"rolling_{choice}_{name}"
    for choice in CHOICES
    for name in ("model_calls_per_run", "drain_s", "took_s", "replayed_runs")
]
FULL_SHARE = 0.9  # the roll starts once this share of the slots is busy
JOINED_S = 3.0  # a new worker's join settles (its rebalance) before the old one stops
DRAIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Size:
    users: int  # one chat message each
    concurrency: int  # each worker's VIGIL_RUN_CONCURRENCY
    delay_s: float
    spread_s: float


SIZES = {
    # 2,000 runs in flight over two workers, each run three answers of 6-10 s: runs are still
    # in flight when each old worker is told to stop (a new worker takes seconds to join).
    "full": Size(users=2_000, concurrency=1_000, delay_s=8.0, spread_s=2.0),
    # `make test`'s smoke run: every figure printed, in about a minute for both choices.
    "quick": Size(users=20, concurrency=20, delay_s=2.0, spread_s=0.5),
}


def script(delay_s: float, spread_s: float) -> dict:
    delay = [delay_s - spread_s, delay_s + spread_s]
    return {
        "rules": [
            {"when": {"tool_result": "send_message"}, "delay": delay, "reply": []},
            {
                "when": {"tool_result": "memory"},
                "delay": delay,
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Checked.", "urgent": False}}],
            },
            {
                "delay": delay,
                "reply": [{"type": "tool_use", "name": "memory", "input": {"command": "view", "path": "/memories"}}],
            },
        ]
    }


def rolling(stack: BenchStack, plan: Plan, report: Report) -> None:
    size = SIZES[plan.name]
    for choice in CHOICES:
        calls, runs, drains, took, replayed = _roll(stack, plan, size, choice)
        report.add(Figure(f"rolling_{choice}_model_calls_per_run", [calls / runs], per="run", note=f"{runs} runs"))
        report.add(Figure(f"rolling_{choice}_drain_s", drains, per="old worker", note="SIGTERM to exit"))
        report.add(Figure(f"rolling_{choice}_took_s", [took], per="roll", note="first join to the last finish"))
        report.add(Figure(f"rolling_{choice}_replayed_runs", [replayed], per="roll", note="journals taken up"))


def _roll(stack: BenchStack, plan: Plan, size: Size, choice: str) -> tuple[int, int, list[float], float, float]:
    settings = {"VIGIL_HANDOVER": choice, "VIGIL_RUN_TIMEOUT_S": "120"}
    with (
        ScriptedServers(
            stack.workdir, size.delay_s, 1, size.spread_s, rules=script(size.delay_s, size.spread_s)
        ) as servers,
        stack.ledger() as dsn,
        stack.topics(plan.partitions) as topics,
    ):
        servers.wait_ready()
        # claude_worker reads only the concurrency, which both benchmarks' sizes have.
        with claude_worker(stack, dsn, topics, size, servers.url, **settings) as workers:  # type: ignore[arg-type]
            workers.add()
            workers.wait_ready()
            with (
                load.BenchProducer(stack.bootstrap, topics.events) as producer,
                psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn,
            ):
                producer.blast(load.encoded(size.users, size.users, f"roll-{choice}"))
                full = FULL_SHARE * min(size.users, 2 * size.concurrency)
                deadline = time.monotonic() + START_TIMEOUT_S
                while workers.metric("vigil_runs_in_flight") < full:
                    if time.monotonic() > deadline:
                        raise ServiceDied(f"the slots did not fill within {START_TIMEOUT_S:.0f}s")
                    workers.check()
                    time.sleep(0.1)
                began = time.monotonic()
                drains, replayed = [], 0.0
                for old in list(workers.procs):
                    workers.add().wait_healthy(START_TIMEOUT_S)
                    time.sleep(JOINED_S)
                    replayed += old.metric("vigil_run_replays_total", 'reason="replayed"')
                    stopping = time.monotonic()
                    old.stop()
                    drains.append(time.monotonic() - stopping)
                    workers.procs.remove(old)
                deadline = time.monotonic() + DRAIN_TIMEOUT_S
                while conn.execute(M.model_bound_runs_done).fetchone()["n"] < size.users:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"not all {size.users} runs finished within {DRAIN_TIMEOUT_S:.0f}s")
                    workers.check()
                    time.sleep(0.5)
                took = time.monotonic() - began
                replayed += workers.metric("vigil_run_replays_total", 'reason="replayed"')
                if conn.execute(M.model_bound_not_messaged).fetchone()["n"]:
                    raise RuntimeError("a run did not end with its message")
        with urllib.request.urlopen(f"{servers.url}/_requests", timeout=60) as response:
            calls = len(json.loads(response.read()))
    return calls, size.users, drains, took, replayed


def summary(report: Report, line) -> None:
    """Both hand-over choices side by side, for the bench's closing summary (no target)."""
    v = report.value
    parts = []
    for choice in CHOICES:
        calls, drain, took, replayed = (
            v(f"rolling_{choice}_{n}") for n in ("model_calls_per_run", "drain_s", "took_s", "replayed_runs")
        )
        if None in (calls, drain, took, replayed):
            line("rolling", None, "missing input", None)
            return
        parts.append(
            f"{choice}: {calls:.2f} model calls per run (3 = none paid twice), drain {drain:.1f} s (median),"
            f" all done {took:.0f} s after the first join, {replayed:.0f} runs replayed"
        )
    line("rolling", v("rolling_step_drain_s"), "; ".join(parts) + " (no target)", None)
