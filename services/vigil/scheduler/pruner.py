"""The ledger pruner: a thread of the scheduler process that applies retention.

What is kept and what goes is the ledger's rule (:mod:`vigil.ledger.retention`); this module
decides when: once at start and then every ``PRUNE_INTERVAL_S``, on a daemon thread of its
own so that a long prune never delays a timer. It also keeps the events partitions made
ahead, so it runs whether or not retention is on. The scheduler service starts it
(:func:`vigil.scheduler.main.serve`): one per ledger shard, each on its own thread, so a shard
that does not answer (or answers slowly) delays no other shard's upkeep.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg

from vigil.clock import Clock, SystemClock, utc
from vigil.ledger import journal as ledger_journal
from vigil.ledger.db import connect
from vigil.ledger.retention import DEFAULT_DEDUP_WINDOW_DAYS, ensure_partitions, prune
from vigil.scheduler import metrics
from vigil.scheduler.settings import SchedulerSettings

log = logging.getLogger("vigil.retention")

PRUNE_INTERVAL_S = 3600.0


def start_pruners(settings: SchedulerSettings, stopping: threading.Event, clock: Clock | None = None) -> list[Pruner]:
    """A pruner per ledger shard (VIGIL_LEDGER_SHARDS), each started on its thread."""
    return [start_pruner(settings, stopping, shard=shard, clock=clock) for shard in range(len(settings.shard_dsns))]


def start_pruner(
    settings: SchedulerSettings, stopping: threading.Event, *, shard: int = 0, clock: Clock | None = None
) -> Pruner:
    """Start the pruner of one shard on its thread, counting what it deletes in
    ``vigil_ledger_pruned_rows_total``."""

    def pruned(counts: dict[str, int]) -> None:
        for table, n in counts.items():
            metrics.PRUNED.labels(table, str(shard)).inc(n)

    return Pruner(
        settings.shard_dsns[shard],
        settings.retention_days,
        stopping,
        on_pruned=pruned,
        dedup_window_days=settings.dedup_window_days,
        journal_days=settings.run_journal_days,
        clock=clock,
        name=f"retention-{shard}" if len(settings.shard_dsns) > 1 else "retention",
    ).start()


class Pruner:
    """Keeps the events partitions made ahead and prunes (when ``retention_days`` > 0), now and
    every ``interval_s``, on a daemon thread until ``stopping`` is set. What is past its days is
    judged at ``clock``'s now (the scheduler's), in the ledger too.

    A ledger error is tried again at the next interval. Anything else ends the thread with
    ``error`` set and sets ``stopping``: the scheduler stops and exits non-zero, rather than
    carrying on healthy-looking while no partition is made ahead and nothing is pruned.
    """

    def __init__(
        self,
        dsn: str,
        retention_days: float,
        stopping: threading.Event,
        on_pruned=lambda counts: None,
        interval_s: float = PRUNE_INTERVAL_S,
        dedup_window_days: float = DEFAULT_DEDUP_WINDOW_DAYS,
        journal_days: int = 0,
        name: str = "retention",
        clock: Clock | None = None,
    ):
        self.dsn, self.retention_days, self.stopping = dsn, retention_days, stopping
        self.on_pruned, self.interval_s = on_pruned, interval_s
        self.dedup_window_days = dedup_window_days
        self.journal_days = journal_days
        self.clock = clock or SystemClock()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Pruner:
        # Always: the partitions ahead are needed whether or not anything is ever deleted.
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stopping.is_set():
            began = time.monotonic()  # a measurement, not a decision: the host's clock
            try:
                now = utc(self.clock.now())
                with connect(self.dsn, autocommit=True) as conn:
                    if self.retention_days > 0:
                        counts = prune(
                            conn,
                            retention_days=self.retention_days,
                            now=now,
                            dedup_window_days=self.dedup_window_days,
                        )
                    else:
                        ensure_partitions(conn)
                        counts = {}
                    # Whatever the events' retention: kept journals past their days, and live
                    # ones their runs abandoned (their events died) past the dedup window.
                    counts["run_journal"] = ledger_journal.prune(
                        conn, keep_days=self.journal_days, live_days=max(1, round(self.dedup_window_days)), now=now
                    )
                self.on_pruned(counts)
                if any(counts.values()):
                    log.info(
                        "retention (%g days): deleted %s in %.1f s",
                        self.retention_days,
                        ", ".join(f"{n} {table}" for table, n in counts.items() if n),
                        time.monotonic() - began,
                    )
            except psycopg.Error as exc:
                log.warning("%s: prune failed (next try in %.0f s): %s", self.thread.name, self.interval_s, exc)
            except Exception as exc:
                log.exception("retention pruner died, stopping the scheduler", extra={"event": "loop_died"})
                self.error = exc
                self.stopping.set()
                return
            self.stopping.wait(self.interval_s)
