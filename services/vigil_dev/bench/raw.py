"""The raw limits of this machine, measured in the same run as vigil's figures.

- ``raw_kafka_events_per_s``: the same events vigil's workloads produce (count, size, key
  spread), produced with vigil's producer settings while one plain consumer in another
  process reads them: events / (first produce call .. last message read).
- ``raw_pg_rows_per_s``: one client inserting events-shaped rows into the ledger's own
  ``events`` table (its indexes and constraints), one multi-row ``INSERT ... ON CONFLICT DO
  NOTHING`` per batch of the worker's poll batch size, each batch its own transaction,
  committed with the ledger sessions' durability (``synchronous_commit=on``). Two
  ways of handing the rows over are timed, column arrays (``unnest``) and a binary COPY into
  a staging table (what the worker does); the faster is the limit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime

import psycopg
from psycopg.types.json import Jsonb

from vigil.ledger.db import SESSION_OPTIONS
from vigil_dev.bench import load
from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.sql import B
from vigil_dev.bench.stack import BenchStack

RAW_USERS = 1000


def raw_kafka(stack: BenchStack, plan: Plan, report: Report) -> Figure:
    samples = []
    for round_ in range(plan.rounds):
        with stack.topics(plan.partitions) as topics:
            messages = load.encoded(plan.raw_events, RAW_USERS, f"raw{round_}")
            reader = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vigil_dev.bench.rawconsume",
                    stack.bootstrap,
                    topics.events,
                    str(plan.partitions),
                    str(len(messages)),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                if reader.stdout.readline().strip() != "ready":
                    reader.kill()
                    raise RuntimeError(f"the raw consumer did not start: {reader.stderr.read()[-500:]}")
                with load.BenchProducer(stack.bootstrap, topics.events) as producer:
                    produced = producer.blast(messages)
                out, _ = reader.communicate(timeout=180)
            finally:
                if reader.poll() is None:
                    reader.kill()
            _, seen, _size, finished = out.split()
            if int(seen) < len(messages):
                raise RuntimeError(f"the raw consumer read {seen} of {len(messages)}")
            samples.append(len(messages) / (float(finished) - produced.started))
    size = sum(len(v) for _, v in messages) / len(messages)
    return report.add(
        Figure(
            "raw_kafka_events_per_s",
            samples,
            note=f"{plan.raw_events} events of {size:.0f} B, {RAW_USERS} keys, {plan.partitions} partitions",
        )
    )


def _batches(count: int, batch: int, source: str) -> list[dict[str, list]]:
    """Column arrays as the worker's consumer builds them, ``batch`` rows each."""
    now = datetime.now(UTC)
    out: list[dict[str, list]] = []
    for start in range(0, count, batch):
        rows = [load.event(i, RAW_USERS, source, now) for i in range(start, min(count, start + batch))]
        out.append(
            {
                "user_id": [e.user_id for e in rows],
                "source": [e.source for e in rows],
                "source_id": [e.source_id for e in rows],
                "kind": [e.kind for e in rows],
                "payload": [e.payload for e in rows],
                "session_id": [e.session_id for e in rows],
                "headers": [Jsonb(e.headers) for e in rows],
                "occurred_at": [e.occurred_at for e in rows],
                "received_at": [e.received_at for e in rows],
                "topic": ["bench.raw"] * len(rows),
                "partition": [i % 12 for i in range(len(rows))],
                "offset": list(range(start, start + len(rows))),
            }
        )
    return out


def _insert_unnest(conn: psycopg.Connection, columns: dict[str, list]) -> None:
    conn.execute(B.raw_insert_events, columns, prepare=True)


def _insert_staged(conn: psycopg.Connection, columns: dict[str, list]) -> None:
    """The worker's own COPY (:func:`vigil.ledger.events.copy_rows`)."""
    from vigil.ledger.events import copy_rows

    with conn.cursor() as cur:
        copy_rows(cur, ((n, *row) for n, row in enumerate(zip(*columns.values()))))
        cur.execute(B.raw_insert_staged, prepare=True)


METHODS = {"staged": _insert_staged, "unnest": _insert_unnest}


def raw_pg(stack: BenchStack, plan: Plan, report: Report, batch: int) -> Figure:
    """Both ways a plain client writes a batch: the faster one is the limit, per round."""
    from vigil.ledger.events import prepare_record_connection

    rates: dict[str, list[float]] = {name: [] for name in METHODS}
    # The ledger sessions' own options (synchronous_commit=on among them): the limit is measured
    # at the durability vigil's figures are taken at.
    with stack.ledger() as dsn, psycopg.connect(dsn, options=SESSION_OPTIONS) as conn:
        prepare_record_connection(conn)
        for round_ in range(plan.rounds + 1):  # round 0 warms the cache and prepares the statements
            for name, insert in METHODS.items():
                conn.execute(B.truncate_events)
                conn.commit()
                batches = _batches(plan.raw_events, batch, f"raw{round_}{name}")
                started = time.perf_counter()
                for columns in batches:
                    insert(conn, columns)
                    conn.commit()
                elapsed = time.perf_counter() - started
                if round_ > 0:
                    rates[name].append(plan.raw_events / elapsed)
    best = [max(pair) for pair in zip(*rates.values())]
    figure = report.add(
        Figure(
            "raw_pg_rows_per_s", best, note=f"batches of {batch} rows, one transaction each, the faster way per round"
        )
    )
    for name, samples in rates.items():
        report.add(Figure(f"raw_pg_{name}_rows_per_s", samples, note=_METHOD_NOTES[name]))
    return figure


_METHOD_NOTES = {
    "staged": "binary COPY into a staging table, then INSERT ... SELECT ... ON CONFLICT DO NOTHING",
    "unnest": "INSERT ... SELECT FROM unnest(column arrays) ... ON CONFLICT DO NOTHING",
}
