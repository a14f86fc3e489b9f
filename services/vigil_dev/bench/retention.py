"""``retention_drop_day_s``: how long retention takes to drop one day of events.

A fresh ledger gets one day, 40 days old, of ``plan.retention_events`` events finished then, with
their dedup keys (written by ``generate_series``: the figure is the drop, not the load);
then the scheduler's own step (``vigil.ledger.retention.drop_event_day``: count the day,
drop its partition) is timed. The keys must all
still be there afterwards: a retried webhook of that day is still a duplicate.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import psycopg
from psycopg.rows import dict_row

from vigil.ledger.retention import drop_event_day
from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.sql import B
from vigil_dev.bench.stack import BenchStack

AGE_DAYS = 40


def drop_day(stack: BenchStack, plan: Plan, report: Report) -> Figure:
    day = (datetime.now(UTC) - timedelta(days=AGE_DAYS)).date()
    name = "events_finished_p" + day.strftime("%Y%m%d")
    with stack.ledger() as dsn, psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SET synchronous_commit = off")  # the load is not what is measured
        conn.execute(B.retention_make_day, {"day": day})
        conn.execute(B.retention_fill_day, {"day": day, "n": plan.retention_events})
        conn.execute("VACUUM ANALYZE events_finished, event_keys")
        conn.execute("RESET synchronous_commit")
        began = time.monotonic()
        dropped = drop_event_day(conn, name)
        took = time.monotonic() - began
        keys = conn.execute(B.count_keys).fetchone()["n"]
    if dropped != plan.retention_events or keys != plan.retention_events:
        raise RuntimeError(f"dropped {dropped} events and kept {keys} keys of {plan.retention_events}")
    note = f"one day of {plan.retention_events} finished events; {keys} dedup keys kept"
    return report.add(Figure("retention_drop_day_s", [took], per="run", note=note))
