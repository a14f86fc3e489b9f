"""What an event and a run cost, counted rather than timed: the figures behind docs/scaling.md.

Two passes on one worker (echo agent), each half load of its shape offered for
``plan.cost_seconds`` and drained, with every counter read before and after:

- ``..._per_event`` (workload ``costs``, ``pipeline.per_event_costs``): ``plan.users`` users (the e2e shape: a run takes
  what a user's events piled up in the batch window), per event recorded and finished;
- ``..._per_run`` (workload ``single``, after its throughput rounds, same worker):
  ``plan.memory_users`` users and ``VIGIL_BATCH_MAX=1`` (every run carries one event: what a
  run costs on its own), per run.

Counters: the worker process's CPU time (``/proc``); PostgreSQL's CPU time (the postmaster,
its live backends and the children it reaped, so vacuum and the checkpointer count too: the
bench's server serves nothing else, a shared one would add its neighbours); rows written
(inserts, updates and deletes in ``pg_stat_user_tables``; a row moved by an UPDATE counts once);
WAL bytes; committed transactions of the ledger database. CPU times depend on the machine
and its neighbours; the counts do not.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
from psycopg.rows import dict_row

from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.procs import Workers
from vigil_dev.bench.sql import B, wal_kept

if TYPE_CHECKING:  # the workloads in pipeline.py call these with their EndToEnd
    from vigil_dev.bench.pipeline import EndToEnd

TICKS = 100.0  # clock ticks per second in /proc (USER_HZ, 100 on Linux)
# Backends report their counters at most once a second, and an idle one within 10 s: the
# full run waits that long before each reading (the quick run less: its counts may fall short).
COUNTERS = ("worker_cpu_us", "pg_cpu_us", "rows_written", "wal_bytes", "transactions")


def _cpu_s(pid: int, children: bool = False) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the name: state is field 3, utime 14, stime 15, cutime 16, cstime 17 (1-based).
    used = int(fields[11]) + int(fields[12])
    if children:
        used += int(fields[13]) + int(fields[14])
    return used / TICKS


def postmaster_pid(dsn: str) -> int | None:
    # The backend's parent, read while the connection is open: once it closes, the backend
    # exits, and reading it then found nothing now and then (PostgreSQL's CPU printed as 0).
    with psycopg.connect(dsn, autocommit=True) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        try:
            return int(Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return None  # PostgreSQL on another machine: its CPU cannot be read from here


def pg_cpu_s(postmaster: int) -> float:
    total = _cpu_s(postmaster, children=True)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == postmaster:
                    total += (int(stat[11]) + int(stat[12])) / TICKS
            except OSError:
                continue  # gone meanwhile: its time is in the postmaster's cutime now
    return total


def _snapshot(dsn: str, worker_pid: int, postmaster: int | None) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(B.cost_counters).fetchone()
    return {
        "worker_cpu_us": _cpu_s(worker_pid) * 1e6,
        "pg_cpu_us": pg_cpu_s(postmaster) * 1e6 if postmaster else 0.0,
        "rows_written": float(row["rows_written"]),
        "wal_bytes": float(row["wal_bytes"]),
        "transactions": float(row["transactions"]),
    }


def measure(e2e: EndToEnd, workers: Workers, rate: float) -> tuple[dict, int, int]:
    """Offer ``rate`` events/s to ``e2e``'s users and drain; the counters' growth, and the
    events and runs finished (the only round in flight). One ledger: its only shard."""
    (grown,), (events,), (runs,) = measure_shards(e2e, workers, rate)
    return grown, events, runs


def measure_shards(e2e: EndToEnd, workers: Workers, rate: float) -> tuple[list[dict], list[int], list[int]]:
    """:func:`measure` on each of ``e2e``'s ledger shards: per shard, its server's counters'
    growth (the worker's CPU, one process, is in each), and the events and runs it finished."""
    plan = e2e.plan
    postmasters = [postmaster_pid(dsn) for dsn in e2e.dsns]
    pid = workers.procs[0].pid
    time.sleep(plan.cost_settle_s)
    with wal_kept(e2e.dsns):  # the pass's WAL, read back by _print_wal
        before = [_snapshot(dsn, pid, pm) for dsn, pm in zip(e2e.dsns, postmasters)]
        tables_before = [_by_table(dsn) for dsn in e2e.dsns]
        source = e2e._source("cost")
        produced = e2e.producer.in_thread(e2e.producer.paced, rate, plan.cost_seconds, e2e.users, source).result()
        time.sleep(0.3)
        e2e._drain(workers, source, produced.count)
        time.sleep(plan.cost_settle_s)
        after = [_snapshot(dsn, pid, pm) for dsn, pm in zip(e2e.dsns, postmasters)]
        tables_after = [_by_table(dsn) for dsn in e2e.dsns]  # before the bench's own reads below
        grown = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
        done = [_round_done(dsn, source) for dsn in e2e.dsns]
        for shard, dsn in enumerate(e2e.dsns):
            label = f" (shard {shard})" if len(e2e.dsns) > 1 else ""
            _print_tables(tables_before[shard], tables_after[shard], done[shard], label)
            _print_wal(dsn, before[shard]["wal_bytes"], after[shard]["wal_bytes"], done[shard][1], label)
    return grown, [d[0] for d in done], [d[1] for d in done]


def _round_done(dsn: str, source: str) -> tuple[int, int]:
    """A round's events done and their runs, on one ledger (one shard's share of the round)."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        row = conn.execute(B.round_totals, {"source": source}).fetchone()
    return int(row["done"]), int(row["runs"])


def add_figures(report: Report, unit: str, grown: dict, count: int, note: str) -> None:
    for name in COUNTERS:
        report.add(Figure(f"cost_{name}_per_{unit}", [grown[name] / max(count, 1)], per="run", note=note))


Tables = tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]  # rows by table, index scans by table


def _by_table(dsn: str) -> Tables:
    """Each table's inserted, updated (HOT among them) and deleted rows, and each of its
    indexes' scans, so far."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        rows = {r["relname"]: {k: int(r[k]) for k in ("ins", "upd", "hot", "del")} for r in conn.execute(B.cost_tables)}
        scans: dict[str, dict[str, int]] = {}
        for r in conn.execute(B.cost_indexes):
            scans.setdefault(r["relname"], {})[r["indexrelname"]] = int(r["idx_scan"])
    return rows, scans


def _print_tables(before: Tables, after: Tables, done: tuple[int, int], label: str) -> None:
    """Where a cost pass's rows went, per run: one line per table written, with its indexes'
    scans per run (0: written by every insert and non-HOT update, read by no statement)."""
    runs = max(done[1], 1)
    print(
        f"  rows written by table{label}, per run of {done[1]} ({done[0]} events):",
        file=sys.stderr,
    )
    for table, now in sorted(after[0].items()):
        was = before[0].get(table, dict.fromkeys(now, 0))
        grew = {k: now[k] - was[k] for k in now}
        if not (grew["ins"] or grew["upd"] or grew["del"]):
            continue
        scans = after[1].get(table, {})
        looked = ", ".join(
            f"{index} {(n - before[1].get(table, {}).get(index, 0)) / runs:.2f}" for index, n in sorted(scans.items())
        )
        print(
            f"    {table}: {grew['ins'] / runs:.2f} ins, {grew['upd'] / runs:.2f} upd ({grew['hot'] / runs:.2f} HOT),"
            f" {grew['del'] / runs:.2f} del; index scans per run: {looked or 'no index'}",
            file=sys.stderr,
            flush=True,
        )


def _print_wal(dsn: str, since: float, until: float, runs: int, label: str) -> None:
    """Where a cost pass's WAL went, per run, by table or index (pg_walinspect; a server
    without it, or a role that may not read it, prints why)."""
    try:
        with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
            conn.execute(B.cost_walinspect)
            rows = conn.execute(B.cost_wal_by_relation, {"since": int(since), "until": int(until)}).fetchall()
    except psycopg.Error as exc:
        print(f"  WAL by relation{label}: not available ({exc.diag.message_primary or exc})", file=sys.stderr)
        return
    per = max(runs, 1)
    parts = ", ".join(f"{r['relation']} {r['bytes'] / per:.0f} B ({r['records'] / per:.2f})" for r in rows)
    print(f"  WAL by relation{label}, per run (bytes, records): {parts}", file=sys.stderr, flush=True)
