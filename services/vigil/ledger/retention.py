"""Retention: the ledger forgets finished work after ``VIGIL_RETENTION_DAYS``.

What goes, oldest first, in batches (``queries/retention.sql``):

- events that are ``done`` or ``dead``; their dedup keys go with them, so retention is never
  shorter than the dedup window (``VIGIL_DEDUP_WINDOW_DAYS``, checked at start-up): a webhook
  retried or a message redelivered inside the window is still dropped as a duplicate;
- outbox messages ``delivered`` or ``dead``;
- runs that no outbox row points at any more (the outbox goes first);
- timers that are done (fired one-offs, cancelled schedules).

What stays: anything pending, running or waiting for delivery, whatever its age; sessions,
memory, approvals, users, the audit trail. The scheduler prunes once at start and then every
``PRUNE_INTERVAL_S`` on a thread of its own, so a long prune never delays a timer. Several
replicas may prune at once: each batch locks its rows ``SKIP LOCKED``.

Dropping a whole time partition would be cheaper than deleting rows; ``events`` is one table
today (see docs), so this deletes in batches small enough to keep each transaction short.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta

import psycopg

from vigil.ledger.db import connect
from vigil.ledger.queries import Q

log = logging.getLogger("vigil.retention")

PRUNE_INTERVAL_S = 3600.0
# Rows per DELETE: each batch is one short transaction (tens of milliseconds).
BATCH = 2000
# Batches per table per prune: a large first prune is spread over several intervals rather
# than holding the ledger busy for minutes.
MAX_BATCHES = 500
# Order matters: the outbox before the runs it points at.
TABLES = (("events", "prune_events"), ("outbox", "prune_outbox"), ("runs", "prune_runs"), ("timers", "prune_timers"))


def prune(
    conn: psycopg.Connection,
    retention_days: float,
    now: datetime | None = None,
    batch: int = BATCH,
    max_batches: int = MAX_BATCHES,
) -> dict[str, int]:
    """Delete what retention allows, table by table. Returns the rows deleted per table."""
    before = (now or datetime.now(UTC)) - timedelta(days=retention_days)
    deleted: dict[str, int] = {}
    for table, query in TABLES:
        total = 0
        for _ in range(max_batches):
            with conn.transaction():
                n = conn.execute(Q[query], {"before": before, "batch": batch}).rowcount
            total += n
            if n < batch:
                break
        deleted[table] = total
    return deleted


class Pruner:
    """Prunes now and every ``interval_s`` on a daemon thread until ``stopping`` is set."""

    def __init__(
        self,
        dsn: str,
        retention_days: float,
        stopping: threading.Event,
        on_pruned=lambda counts: None,
        interval_s: float = PRUNE_INTERVAL_S,
    ):
        self.dsn, self.retention_days, self.stopping = dsn, retention_days, stopping
        self.on_pruned, self.interval_s = on_pruned, interval_s
        self.thread = threading.Thread(target=self._loop, name="retention", daemon=True)

    def start(self) -> Pruner:
        if self.retention_days > 0:
            self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stopping.is_set():
            began = time.monotonic()
            try:
                with connect(self.dsn, autocommit=True) as conn:
                    counts = prune(conn, self.retention_days)
                self.on_pruned(counts)
                if any(counts.values()):
                    log.info(
                        "retention (%g days): deleted %s in %.1f s",
                        self.retention_days,
                        ", ".join(f"{n} {table}" for table, n in counts.items() if n),
                        time.monotonic() - began,
                    )
            except psycopg.Error as exc:
                log.warning("retention prune failed (next try in %.0f s): %s", self.interval_s, exc)
            self.stopping.wait(self.interval_s)
