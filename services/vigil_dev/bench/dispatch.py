"""``dispatch_deliveries_per_s``: how fast one dispatcher relays a full outbox.

A fresh ledger holds ``plan.dispatch_users`` users, each with one message in the outbox as a
run's finish writes it and a Kafka channel: every delivery is an Avro record the broker
acknowledged, then its outcome recorded, as in production. One ``vigil dispatcher`` process
with its defaults drains it (every user is due: none was ever delivered to); the figure is
its deliveries per second from the first to the last, and the dispatcher's CPU per
delivery beside it. The outbox after an outage, or users whose channels have no gap, look
like this; with the default one-hour gap a user gets at most one delivery an hour.
"""

from __future__ import annotations

import time

import psycopg

from vigil_dev.bench.costs import pg_cpu_s, postmaster_pid
from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.model_bound import cpu_seconds
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.procs import Service, base_env
from vigil_dev.bench.sql import B
from vigil_dev.bench.stack import BenchStack
from vigil_dev.devstack import free_port

FIGURES = ["dispatch_deliveries_per_s", "dispatch_cpu_ms_per_delivery", "dispatch_pg_cpu_ms_per_delivery"]
DELIVERED = "vigil_deliveries_total"
TIMEOUT_S = 300.0


def dispatch(stack: BenchStack, plan: Plan, report: Report) -> None:
    rates: list[float] = []
    cpu: list[float] = []
    pg_cpu: list[float] = []
    for _ in range(plan.rounds):
        rate, cpu_ms, pg_ms = _round(stack, plan.dispatch_users)
        rates.append(rate)
        cpu.append(cpu_ms)
        pg_cpu.append(pg_ms)
    note = f"{plan.dispatch_users} users, one message each, Kafka channel, one dispatcher (defaults)"
    report.add(Figure("dispatch_deliveries_per_s", rates, note=note))
    report.add(Figure("dispatch_cpu_ms_per_delivery", cpu, note="the dispatcher's own CPU"))
    report.add(
        Figure("dispatch_pg_cpu_ms_per_delivery", pg_cpu, note="the whole PostgreSQL server's CPU, autovacuum included")
    )


def _round(stack: BenchStack, users: int) -> tuple[float, float, float]:
    with stack.ledger() as dsn, stack.topics(1) as topics:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(B.dispatch_fill, {"users": users})
            conn.execute("VACUUM ANALYZE outbox, users, channels")
        port = free_port()
        env = base_env(stack, dsn, topics)
        env["VIGIL_DISPATCHER_PORT"] = str(port)
        service = Service("dispatcher", ["dispatcher"], env, port, stack.workdir / f"{topics.events}-dispatcher.log")
        postmaster = postmaster_pid(dsn)
        service.start()
        try:
            service.wait_healthy()
            began = cpu_seconds(service.pid)
            pg_began = pg_cpu_s(postmaster) if postmaster else 0.0
            first = last = None
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                done = service.metric(DELIVERED, 'result="delivered"')
                now = time.monotonic()
                if first is None and done > 0:
                    first = (now, done)
                if done >= users:
                    last = now
                    break
                if now > deadline:
                    raise RuntimeError(f"{done:.0f} of {users} delivered in {TIMEOUT_S:.0f} s")
                time.sleep(0.05)
            used = cpu_seconds(service.pid) - began
            pg_used = (pg_cpu_s(postmaster) - pg_began) if postmaster else 0.0
        finally:
            service.stop()
        with psycopg.connect(dsn) as conn:
            delivered = conn.execute(B.dispatch_delivered).fetchone()[0]
    if delivered != users:
        raise RuntimeError(f"the ledger shows {delivered} of {users} delivered")
    assert first is not None and last is not None
    took = max(last - first[0], 1e-3)
    return (users - first[1]) / took, used * 1000 / users, pg_used * 1000 / users
