"""The model-bound workload: a worker whose runs wait on the model for seconds.

Real runs spend almost all their time waiting for the Messages API, so what a worker
carries is how many runs it holds in flight and what each costs it in CPU while they wait.
Here one ``vigil worker`` runs the real Claude agent (the real ``anthropic`` client) with a
high ``VIGIL_RUN_CONCURRENCY`` against the scripted Messages API server
(:mod:`vigil_dev.scripted_server`) in processes of its own, whose script answers every
first call with a ``send_message`` tool use after a wait drawn uniformly from ``delay_s`` +/-
``spread_s`` (3-7 s at full size), and the call after it (the tool result) at once with an
end of turn. Every user has one chat message, produced all at once, so the worker has a
backlog from the first second to the last.

The wait varies as real answers do. With one fixed wait the backlog's runs moved in
lockstep: the first 2,500 answers came back in the same second, the worker spent the next
seconds on them while nothing else arrived, and then idled until the next wave (its event
loop stalled for 200-560 ms at a time and sat idle about 40% of the stretch). That workload
measured the waves, not the worker: more runs per loop wake-up made each look cheaper (1.9
ms against 2.3-2.4 ms of CPU) and the idle stretches made the rate lower (0.65-0.82 of the
ideal against about 0.9).

Figures:

- ``model_bound_delay_s``: the server's mean answer delay (what one run takes on average at
  least).
- ``model_bound_runs_in_flight``: runs started and not finished, from the ``runs`` rows,
  at evenly spaced moments between the first run's start and the last run's start (while
  there is a backlog, every slot should be busy).
- ``model_bound_runs_per_s``: runs finished while the slots were full / that stretch's length
  (first run's start + one delay .. last run's start: the ramp and the drain do not count,
  as in the end-to-end rounds); the whole span's rate (runs / first start .. last finish)
  is printed beside it.
- ``model_bound_worker_cpu_ms_per_run``: the worker process's user + system CPU time from
  ``/proc`` over the whole workload (recording, claims, both model calls, finishes) / runs.
- ``model_bound_worker_rss_mb``: the worker's resident memory, sampled twice a second
  while the slots were full (first run's start + one delay .. last run's start).

The server's own CPU is printed beside the rate: if it used most of a core, the server and
not the worker set the pace, and the delay should be longer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from vigil.ledger.queries import Queries, parse
from vigil_dev.bench import load
from vigil_dev.bench.figures import Figure, Report, fmt
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.procs import START_TIMEOUT_S, STOP_TIMEOUT_S, ServiceDied, Workers
from vigil_dev.bench.sql import wal_kept
from vigil_dev.bench.stack import BenchStack
from vigil_dev.devstack import free_port

FIGURES = [
    "model_bound_delay_s",
    "model_bound_runs_in_flight",
    "model_bound_runs_per_s",
    "model_bound_worker_cpu_ms_per_run",
    "model_bound_worker_rss_mb",
    "model_bound_journal_rows_per_run",
    "model_bound_journal_wal_bytes_per_run",
]
# The targets: slots held, share of the ideal rate, CPU and memory per worker.
TARGET_IN_FLIGHT = 2000
TARGET_RATE_SHARE = 0.8
TARGET_CPU_MS = 2.0
TARGET_RSS_MB = 400.0

M = Queries(
    parse(
        text=(Path(__file__).resolve().parent / "model_bound.sql").read_text(encoding="utf-8"), origin="model_bound.sql"
    )
)

POLL_S = 0.5
IDLE_S = 3.0  # the idle worker's CPU is measured this long before the load
IN_FLIGHT_SAMPLES = 200
DRAIN_TIMEOUT_S = 600.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Size:
    users: int  # one chat message each
    concurrency: int  # the worker's VIGIL_RUN_CONCURRENCY
    delay_s: float  # the server's answer to each run's first call: its mean wait
    spread_s: float  # each wait drawn uniformly from delay_s +/- spread_s
    servers: int  # scripted server processes sharing one port


SIZES = {
    # 4 full waves of 2,500 runs: the slots stay full from the first claim to the last.
    "full": Size(users=10_000, concurrency=2_500, delay_s=5.0, spread_s=2.0, servers=1),
    # Two waves, small enough for `make test`'s smoke run on a busy machine.
    "quick": Size(users=100, concurrency=50, delay_s=0.5, spread_s=0.2, servers=1),
}


def script(delay_s: float, spread_s: float = 0.0, hold: Path | None = None) -> dict:
    """Every first call: after ``delay_s`` +/- ``spread_s`` (drawn uniformly per call), a
    send_message; the call with its result: done at once. ``hold``: first calls also wait
    until that file exists (``ScriptedServers.release``)."""
    reply = {
        "name": "reply",
        "delay": [delay_s - spread_s, delay_s + spread_s],
        "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "On it.", "urgent": False}}],
    }
    if hold is not None:
        reply["hold"] = str(hold)
    return {"rules": [{"name": "done", "when": {"tool_result": "send_message"}, "reply": []}, reply]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (``/proc/<pid>/stat``, Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class ScriptedServers:
    """``count`` scripted server processes on one port (``--load``: SO_REUSEPORT, no recording).
    ``rules``: a script of the caller's instead of the model-bound one, on one process that
    records every request (``GET /_requests``). ``held``: first calls are not answered before
    ``release()``."""

    def __init__(
        self,
        workdir: Path,
        delay_s: float,
        count: int,
        spread_s: float = 0.0,
        rules: dict | None = None,
        held: bool = False,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = workdir / f"model-bound-script-{self.port}.json"
        self.hold = workdir / f"model-bound-hold-{self.port}"
        path.write_text(json.dumps(rules or script(delay_s, spread_s, self.hold if held else None)))
        self.log_path = workdir / f"model-bound-server-{self.port}.log"
        args = [sys.executable, "-m", "vigil_dev.scripted_server", "--script", str(path)]
        args += ["--port", str(self.port), "--log-level", "warning"] + ([] if rules else ["--load"])
        self.procs: list[subprocess.Popen] = []
        with open(self.log_path, "ab") as out:
            for _ in range(count):
                self.procs.append(
                    subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                )

    def wait_ready(self) -> ScriptedServers:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.5):
                return self
            time.sleep(0.1)
        raise ServiceDied(f"scripted server not listening within {START_TIMEOUT_S:.0f}s")

    def check(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                log = self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""
                raise ServiceDied(f"scripted server exited ({proc.returncode}):\n{log}")

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(proc.pid) for proc in self.procs)

    def release(self) -> None:
        """Held first calls go (after their delay, counted from their arrival or later)."""
        self.hold.touch()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def __enter__(self) -> ScriptedServers:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


@contextlib.contextmanager
def claude_worker(stack: BenchStack, dsn: str, topics, size: Size, url: str, **settings: str) -> Iterator[Workers]:
    with Workers(
        stack,
        dsn,
        topics,
        1,
        VIGIL_AGENT="claude",
        ANTHROPIC_API_KEY="bench-key",  # the scripted server wants one; it goes nowhere else
        ANTHROPIC_BASE_URL=url,
        VIGIL_RUN_CONCURRENCY=str(size.concurrency),
        VIGIL_MODEL_MAX_CONNECTIONS=str(size.concurrency),
        **settings,
    ) as workers:
        yield workers


@contextlib.contextmanager
def claude_stack(
    stack: BenchStack, plan: Plan, size, servers: int = 1, held: bool = False, **settings: str
) -> Iterator[tuple]:
    """Scripted servers answering after ``size.delay_s`` +/- ``size.spread_s`` (``held``: and
    not before ``servers.release()``), a ledger, the topics and one worker running the Claude
    agent against them (``settings``: its environment beyond the bench's), ready (partitions
    held): ``(servers, dsn, topics, workers)``."""
    with (
        ScriptedServers(stack.workdir, size.delay_s, servers, size.spread_s, held=held) as scripted,
        stack.ledger() as dsn,
        stack.topics(plan.partitions) as topics,
    ):
        scripted.wait_ready()
        with claude_worker(stack, dsn, topics, size, scripted.url, **settings) as workers:
            workers.wait_ready()
            yield scripted, dsn, topics, workers


def wait_finished(conn, users: int, workers: Workers, servers: ScriptedServers, each_poll=None) -> None:
    """Until every user's run has finished (one message each), checking that the processes live."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while conn.execute(M.model_bound_runs_done).fetchone()["n"] < users:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not all {users} runs finished within {DRAIN_TIMEOUT_S:.0f}s")
        workers.check()
        servers.check()
        if each_poll is not None:
            each_poll()
        time.sleep(POLL_S)


def model_bound(stack: BenchStack, plan: Plan, report: Report) -> None:
    size = SIZES[plan.name]
    report.add(
        Figure(
            "model_bound_delay_s",
            [size.delay_s],
            per="setting",
            note=f"the scripted server's mean answer delay; each drawn from {size.delay_s - size.spread_s:g}"
            f"-{size.delay_s + size.spread_s:g} s",
        )
    )
    with claude_stack(stack, plan, size, size.servers) as (servers, dsn, topics, workers):
        worker = workers.procs[0]
        messages = load.encoded(size.users, size.users, "mb")
        # What the worker burns with nothing to do (consumer and producer polls, claim
        # scans), to tell per-run cost from the clock's.
        idle_before = cpu_seconds(worker.pid)
        time.sleep(IDLE_S)
        idle_per_s = (cpu_seconds(worker.pid) - idle_before) / IDLE_S
        cpu_before, server_before = cpu_seconds(worker.pid), servers.cpu_seconds()
        rss: list[tuple[float, float]] = []  # (wall clock, MB)
        with (
            load.BenchProducer(stack.bootstrap, topics.events) as producer,
            psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn,
            wal_kept([dsn]),  # the journal's WAL, read back by _journal_cost
        ):
            mark = conn.execute(M.model_bound_journal_mark).fetchone()
            producer.blast(messages)
            wait_finished(conn, size.users, workers, servers, lambda: rss.append((time.time(), rss_mb(worker.pid))))
            cpu = cpu_seconds(worker.pid) - cpu_before
            server_cpu = servers.cpu_seconds() - server_before
            runs = conn.execute(M.model_bound_runs).fetchall()
            failed = conn.execute(M.model_bound_not_messaged).fetchone()["n"]
            journal = _journal_cost(conn, mark)
    if failed:
        raise RuntimeError(f"{failed} of {len(runs)} runs did not end with their message")
    _figures(report, size, runs, cpu, server_cpu, rss, idle_per_s)
    rows, wal = journal
    report.add(
        Figure(
            "model_bound_journal_rows_per_run",
            [rows / len(runs)],
            per="run",
            note='journal steps appended per run (docs/worker.md, "Durable runs"): one per model answer',
        )
    )
    if wal is not None:
        report.add(
            Figure(
                "model_bound_journal_wal_bytes_per_run",
                [wal / len(runs)],
                per="run",
                note="WAL of the records touching run_journal and its indexes (appends and the finishes' deletes),"
                " read back with pg_walinspect",
            )
        )


STATS_FLUSH_S = 2.0


def _journal_cost(conn, mark: dict) -> tuple[int, int | None]:
    """The journal's rows appended since ``mark`` and their WAL (None without pg_walinspect)."""
    time.sleep(STATS_FLUSH_S)  # backends report their row counts at most once a second
    now = conn.execute(M.model_bound_journal_mark).fetchone()
    rows = now["rows"] - mark["rows"]
    try:
        conn.execute(M.model_bound_journal_walinspect)
        wal = conn.execute(M.model_bound_journal_wal, {"since": mark["lsn"], "until": now["lsn"]}).fetchone()["bytes"]
    except psycopg.Error as exc:
        print(f"model_bound: the journal's WAL not read back: {exc}".rstrip(), file=sys.stderr)
        wal = None
    return rows, wal


def _figures(
    report: Report, size: Size, runs: list[dict], cpu: float, server_cpu: float, rss: list, idle_per_s: float
) -> None:
    starts = sorted(r["started"] for r in runs)
    spans = sorted((r["started"], r["finished"]) for r in runs)
    first, last_start = starts[0], starts[-1]
    last_finish = max(r["finished"] for r in runs)
    step = (last_start - first) / IN_FLIGHT_SAMPLES
    moments = [first + step * (i + 0.5) for i in range(IN_FLIGHT_SAMPLES)] if step > 0 else [first]
    in_flight: list[float] = [sum(1 for s, f in spans if s <= t < f) for t in moments]
    took = last_finish - first
    # The rate while the slots are full (as in-flight and memory are read): from the first
    # run's start plus the mean delay (the first wave is finishing) to the last run's start (the
    # backlog is gone after it, and the last wave's wait finishes nothing new). The ramp and
    # the drain of a finite workload say nothing about what a worker carries; the whole span's
    # rate is printed beside it.
    steady_from, steady_until = first + size.delay_s, last_start
    if steady_until - steady_from >= size.delay_s:
        finished = sum(1 for _, f in spans if steady_from <= f < steady_until)
        rate = finished / (steady_until - steady_from)
        window = f"{finished} runs finished in the {steady_until - steady_from:.1f} s while the slots were full"
    else:  # too short to have a full stretch (the quick size): the whole span
        rate = len(runs) / took
        window = "the whole span"
    at = f"{size.users} users, 1 worker, VIGIL_RUN_CONCURRENCY={size.concurrency}"
    took_s = sorted(f - s for s, f in spans)
    durations = f"a run took {took_s[len(took_s) // 2]:.2f} s (median), {took_s[len(took_s) * 99 // 100]:.2f} s (p99)"
    report.add(
        Figure(
            "model_bound_runs_in_flight",
            in_flight,
            per="moments between the first and the last run's start",
            note=at,
        )
    )
    server_share = server_cpu / took
    report.add(
        Figure(
            "model_bound_runs_per_s",
            [rate],
            per="run",
            note=f"{window}; {durations}; whole span {len(runs) / took:.0f} runs/s ({len(runs)} runs in {took:.1f} s);"
            f" scripted server: {server_share:.0%} of a core"
            f" ({1000 * server_cpu / len(runs):.2f} ms per run, {size.servers} process(es))",
        )
    )
    report.add(
        Figure(
            "model_bound_worker_cpu_ms_per_run",
            [1000 * cpu / len(runs)],
            per="run",
            note=f"{cpu:.1f} CPU-s for {len(runs)} runs: record, claim, 2 model calls, finish; of which"
            f" {1000 * idle_per_s * took / len(runs):.2f} ms the idle worker's own {1000 * idle_per_s:.0f} ms/s",
        )
    )
    full = [mb for t, mb in rss if first + size.delay_s <= t <= last_start] or [mb for _, mb in rss]
    report.add(Figure("model_bound_worker_rss_mb", full, per="samples while the slots were full", note=at))


def summary(report: Report, line) -> None:
    """The model-bound targets, for the bench's closing summary."""
    v = report.value
    delay, in_flight, rate = v("model_bound_delay_s"), v("model_bound_runs_in_flight"), v("model_bound_runs_per_s")
    if None in (delay, in_flight, rate):
        line("model_bound", None, "missing input", None)
        return
    line(
        "model_bound_in_flight",
        in_flight,
        f"{fmt(in_flight)} runs in flight (target >= {TARGET_IN_FLIGHT})",
        in_flight >= TARGET_IN_FLIGHT,
    )
    ideal = in_flight / delay
    line(
        "model_bound_rate",
        rate,
        f"{fmt(rate)} runs/s = {rate / ideal:.2f} x in-flight / delay ({fmt(ideal)}) (target >= {TARGET_RATE_SHARE})",
        rate >= TARGET_RATE_SHARE * ideal,
    )
    cpu = v("model_bound_worker_cpu_ms_per_run")
    if cpu is not None:
        line(
            "model_bound_cpu",
            cpu,
            f"{fmt(cpu)} ms of worker CPU per run (target <= {TARGET_CPU_MS})",
            cpu <= TARGET_CPU_MS,
        )
    rss = v("model_bound_worker_rss_mb")
    if rss is not None:
        line(
            "model_bound_rss",
            rss,
            f"{fmt(rss)} MB at {fmt(in_flight)} in flight (target < {TARGET_RSS_MB:.0f} MB at {TARGET_IN_FLIGHT})",
            rss < TARGET_RSS_MB,
        )
