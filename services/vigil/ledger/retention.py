"""Retention: the ledger forgets finished work after ``VIGIL_RETENTION_DAYS``, and dedup keys
after ``VIGIL_DEDUP_WINDOW_DAYS``.

``events`` keeps its finished rows (``done``, ``dead``) in ``events_finished``, partitioned
by the UTC day of ``finished_at``. The scheduler keeps the days made ahead
(``PARTITIONS_AHEAD_DAYS``; rows that landed in the default partition move to their day) and
drops a day once the whole day is older than retention: one ``DROP`` per day, whatever it
held, never a row-by-row delete. Pending and running events live in ``events_live``, which
retention never touches, so unfinished work stays whatever its age.

The dedup keys live apart, in ``event_keys``: a retried webhook is dropped for the whole
dedup window, also after its first copy's day was dropped. Keys older than the window are
deleted in batches (a narrow table).

What else goes, oldest first, in batches (``queries/retention.sql``):

- outbox messages ``delivered`` or ``dead``;
- runs that no outbox row points at any more (the outbox goes first);
- timers that are done (fired one-offs, cancelled schedules).

What stays: anything pending, running or waiting for delivery, whatever its age; sessions,
memory, approvals, users, the audit trail. The scheduler runs this once at start and then
every hour on a thread of its own (:mod:`vigil.scheduler.pruner`), so a long prune never
delays a timer.
Several replicas may prune at once: partitions are made under an advisory lock, a day is
dropped once (the second replica finds it gone and counts nothing), and each batch of the
other tables locks its rows ``SKIP LOCKED``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
from psycopg import sql
from psycopg.rows import DictRow

from vigil.ledger.queries import Q

# Days of events partitions made ahead of today: the scheduler may be down this long before
# new events land in the default partition (which still takes them; the next run moves them).
PARTITIONS_AHEAD_DAYS = 3
# Rows per DELETE: each batch is one short transaction (tens of milliseconds).
BATCH = 2000
# Batches per table per prune: a large first prune is spread over several intervals rather
# than holding the ledger busy for minutes.
MAX_BATCHES = 500
# How long a day's drop waits for its lock before trying at the next prune: while it waits,
# finishes that come after it queue behind it.
DROP_LOCK_TIMEOUT = "2s"
# Order matters: the outbox before the runs it points at.
TABLES = (("outbox", "prune_outbox"), ("runs", "prune_runs"), ("timers", "prune_timers"))
DEFAULT_DEDUP_WINDOW_DAYS = 7.0


def ensure_partitions(conn: psycopg.Connection[DictRow], ahead: int = PARTITIONS_AHEAD_DAYS) -> int:
    """Make the days of finished events from yesterday to ``ahead`` days ahead. Returns how many were made."""
    with conn.transaction():
        row = conn.execute(Q.ensure_partitions, {"ahead": ahead}).fetchone()
        assert row is not None  # a function's result: one row
        made: int = row["made"]
        return made


def drop_event_day(conn: psycopg.Connection[DictRow], name: str) -> int:
    """Drop one day partition of finished events. Returns the events it dropped.

    Order: count the day, then drop it, each in its own short transaction. The drop locks
    ``events_finished`` (never the live queue the claims read): a finish moving rows in
    waits for it (milliseconds), and the drop waits at most ``DROP_LOCK_TIMEOUT`` for the
    finishes in flight, else it is tried again at the next prune. Another replica that
    dropped the day first leaves nothing to count (0).
    """
    table = sql.Identifier(name)
    try:
        with conn.transaction():
            counted = conn.execute(sql.SQL(Q.count_event_day).format(partition=table)).fetchone()
            assert counted is not None  # a count: one row
            total: int = counted["n"]
    except psycopg.errors.UndefinedTable:
        return 0
    try:
        with conn.transaction():
            conn.execute(f"SET LOCAL lock_timeout = '{DROP_LOCK_TIMEOUT}'")
            conn.execute(sql.SQL(Q.drop_event_day).format(partition=table))
    except psycopg.errors.UndefinedTable:
        return 0  # another replica dropped it between the count and the drop
    return total


def prune(
    conn: psycopg.Connection[DictRow],
    *,
    retention_days: float,
    now: datetime | None = None,
    batch: int = BATCH,
    max_batches: int = MAX_BATCHES,
    dedup_window_days: float = DEFAULT_DEDUP_WINDOW_DAYS,
) -> dict[str, int]:
    """Make the coming days, drop the days past retention, delete what else retention allows
    table by table and the expired dedup keys. Returns the rows deleted per table."""
    now = now or datetime.now(UTC)
    before = now - timedelta(days=retention_days)
    ensure_partitions(conn)
    deleted: dict[str, int] = {"events": 0}
    for row in conn.execute(Q.event_days_past, {"before": before}).fetchall():
        deleted["events"] += drop_event_day(conn, row["name"])
    batches = [(table, query, before) for table, query in TABLES]
    batches.append(("event_keys", "prune_event_keys", now - timedelta(days=dedup_window_days)))
    for table, query, cutoff in batches:
        total = 0
        for _ in range(max_batches):
            with conn.transaction():
                n = conn.execute(Q[query], {"before": cutoff, "batch": batch}).rowcount
            total += n
            if n < batch:
                break
        deleted[table] = total
    return deleted
