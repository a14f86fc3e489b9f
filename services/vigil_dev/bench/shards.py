"""The ledger on two shards, each a PostgreSQL server of its own: what a second shard costs.

One ``vigil worker`` (echo agent) with ``VIGIL_LEDGER_SHARDS`` naming two ledgers, shard 0 on
the bench's server and shard 1 on a second server this workload starts (production
durability, like the first); the 12 partitions of the events topic split by the rule
(``partition % 2``), so each shard holds about half the users.

- ``e2e_2_shards_events_per_s``: the e2e throughput rounds (``pipeline.EndToEnd.throughput``,
  1,000 users) with the events of each round summed over both shards; on 2 cores both
  servers, the broker, the producer and the worker share the same two cores, so it cannot
  beat ``e2e_events_per_s`` (docs/scaling.md): the figure says what the split costs the worker.
- ``cost_<counter>_per_event_2_shards`` and ``..._per_run_2_shards``: the cost counters of
  :mod:`vigil_dev.bench.costs` per event (per single-event run), counted on each shard against
  the events (runs) that shard finished, offered the same total load as the one-shard passes;
  the figure is the mean of the two shards (each printed), and the worker's CPU is per event
  of both. Compared in the summary with ``cost_<counter>_per_event`` (one shard, the same
  offer): the target is within 10% (issue 41).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import psycopg

from vigil.ledger.db import connect
from vigil.ledger.migrate import apply_canonical
from vigil.ledger.shards import seed, space_ids
from vigil_dev import devstack
from vigil_dev.bench import costs
from vigil_dev.bench.figures import Figure, Report, fmt
from vigil_dev.bench.pipeline import EndToEnd
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.procs import Workers
from vigil_dev.bench.stack import BenchStack

SHARDS = 2
UNITS = ("event", "run")
FIGURES = [
    "e2e_2_shards_events_per_s",
    "e2e_2_shards_ratio",
    *[f"cost_{name}_per_{unit}_2_shards" for unit in UNITS for name in costs.COUNTERS],
]
# Counted on each shard's own server; the worker's CPU is the one process's, both shards'.
PER_SHARD = ("pg_cpu_us", "rows_written", "wal_bytes", "transactions")
WITHIN = 0.10  # the target: an event costs each shard what it costs one shard, within 10%


@contextlib.contextmanager
def second_server(stack: BenchStack) -> Iterator[devstack.PostgresServer]:
    """Shard 1's PostgreSQL server, on a free port in the bench's folder; stopped afterwards."""
    assert stack.temp is not None
    server = devstack.PostgresServer(stack.temp / "pg-shard1" / "data", devstack.free_port(), durable=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def ledgers(stack: BenchStack, server: devstack.PostgresServer, partitions: int) -> Iterator[tuple[str, str]]:
    """A fresh ledger on each shard (canonical schema, shard 1's ids in its own range, the map's
    rows seeded on shard 0 by the rule), dropped afterwards; their DSNs, shard 0 first."""
    name = f"vigil_bench_{uuid.uuid4().hex[:10]}"
    with stack.ledger() as dsn0:
        admin = server.admin_url()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        dsn1 = server.admin_url(name)
        try:
            apply_canonical(dsn1)
            with connect(dsn1, autocommit=True) as conn:
                space_ids(conn, shard=1)
            with connect(dsn0, autocommit=True) as conn:
                seed(conn, partitions=partitions, shards=SHARDS)
            yield dsn0, dsn1
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _url(dsn: str) -> str:
    """A ``postgresql://`` URL of a DSN (``VIGIL_LEDGER_SHARDS`` takes URLs only: a libpq
    ``key=value`` string may hold its comma)."""
    parts = psycopg.conninfo.conninfo_to_dict(dsn)
    user, password = quote(str(parts.get("user", "")), safe=""), quote(str(parts.get("password", "")), safe="")
    auth = f"{user}:{password}@" if password else f"{user}@" if user else ""
    host = f"{parts.get('host', '127.0.0.1')}:{parts.get('port', 5432)}"
    return f"postgresql://{auth}{host}/{quote(str(parts['dbname']), safe='')}"


def _workers(stack: BenchStack, dsns: tuple[str, str], topics, **settings: str) -> Workers:
    urls = [_url(dsn) for dsn in dsns]
    return Workers(stack, urls[0], topics, 1, VIGIL_LEDGER_SHARDS=",".join(urls), **settings)


Measured = tuple[list[dict], list[int], list[int]]  # costs.measure_shards: growth, events, runs per shard


def _add_costs(report: Report, unit: str, measured: Measured, note: str) -> None:
    grown, events, runs = measured
    counts = events if unit == "event" else runs
    worker_cpu = grown[0]["worker_cpu_us"]  # one worker process for both shards
    for k, (shard, n) in enumerate(zip(grown, counts)):
        per = ", ".join(f"{name} {fmt(shard[name] / max(n, 1))}" for name in PER_SHARD)
        report.say(f"  shard {k}: {n} {unit}s finished; per {unit}: {per}")
    for name in costs.COUNTERS:
        if name in PER_SHARD:
            values = [shard[name] / max(n, 1) for shard, n in zip(grown, counts)]
        else:
            values = [worker_cpu / max(sum(counts), 1)]
        report.add(Figure(f"cost_{name}_per_{unit}_2_shards", [statistics.mean(values)], per="run", note=note))


def two_shards(
    stack: BenchStack, plan: Plan, report: Report, start_rate: float, event_rate: float, run_rate: float
) -> None:
    """The throughput rounds from ``start_rate``; the per-event costs at ``event_rate`` and the
    per-run costs at ``run_rate`` (what the one-shard passes were offered)."""
    with second_server(stack) as server:
        _throughput_and_event_costs(stack, plan, report, server, start_rate, event_rate)
        _run_costs(stack, plan, report, server, run_rate)


def _throughput_and_event_costs(
    stack: BenchStack, plan: Plan, report: Report, server, start_rate: float, cost_rate: float
) -> None:
    with ledgers(stack, server, plan.partitions) as dsns, stack.topics(plan.partitions) as topics:
        e2e = EndToEnd(stack, plan, dsns[0], topics, plan.users, other_shards=dsns[1:])
        try:
            with _workers(stack, dsns, topics) as workers:
                workers.wait_ready()
                events, _, per_run, _ = e2e.throughput(workers, start_rate)
                note = (
                    f"1 worker, 2 shards on 2 PostgreSQL servers, {plan.users} users, window "
                    f"{plan.default_window_ms} ms, {statistics.median(per_run):.1f} events per run"
                )
                two = report.add(Figure("e2e_2_shards_events_per_s", events, note=note)).value
                one = report.value("e2e_events_per_s")
                if one:
                    report.add(
                        Figure(
                            "e2e_2_shards_ratio",
                            [e / one for e in events],
                            note=f"median {two:.0f} over e2e_events_per_s {one:.0f} (2 cores for everything)",
                        )
                    )
                print(f"  two shards: per-event costs at {cost_rate:.0f} events/s", file=sys.stderr, flush=True)
                measured = costs.measure_shards(e2e, workers, cost_rate)
        finally:
            e2e.producer.close()
    events_done = sum(measured[1])
    note = f"{events_done} events over 2 shards in {sum(measured[2])} runs, {cost_rate:.0f} events/s offered"
    _add_costs(report, "event", measured, note)


def _run_costs(stack: BenchStack, plan: Plan, report: Report, server, rate: float) -> None:
    """The per-run counters with every run carrying one event (the ``single`` workload's
    cost pass)."""
    with ledgers(stack, server, plan.partitions) as dsns, stack.topics(plan.partitions) as topics:
        e2e = EndToEnd(stack, plan, dsns[0], topics, plan.memory_users, other_shards=dsns[1:])
        try:
            with _workers(stack, dsns, topics, VIGIL_BATCH_MAX="1") as workers:
                workers.wait_ready()
                print(f"  two shards: per-run costs at {rate:.0f} events/s", file=sys.stderr, flush=True)
                measured = costs.measure_shards(e2e, workers, rate)
        finally:
            e2e.producer.close()
    note = f"{sum(measured[2])} single-event runs over 2 shards, {rate:.0f} events/s offered"
    _add_costs(report, "run", measured, note)


def summary(report: Report, line) -> None:
    """Each shard's cost per event (per run) against one shard's: the target is within 10%."""
    ratio = report.value("e2e_2_shards_ratio")
    line(
        "e2e_2_shards",
        ratio,
        f"{ratio:.2f} x one shard (no target: both servers share the machine's 2 cores)" if ratio else "missing",
        None,
    )
    for unit in UNITS:
        for name in costs.COUNTERS:
            one, two = report.value(f"cost_{name}_per_{unit}"), report.value(f"cost_{name}_per_{unit}_2_shards")
            if one is None or two is None or one == 0:
                line(f"shard_cost_{name}_per_{unit}", None, "missing input", None)
                continue
            ratio = two / one
            line(
                f"shard_cost_{name}_per_{unit}",
                ratio,
                f"{fmt(two)} on each of 2 shards / {fmt(one)} on one = {ratio:.2f} (target <= {1 + WITHIN:.2f})",
                ratio <= 1 + WITHIN,
            )
