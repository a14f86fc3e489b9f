"""Background tasks' upkeep: reaping them, reporting their results as events, their gauges.

This is fleet-wide work on the ``tasks`` table, the same whichever tasks this process holds
(their execution is :mod:`vigil.worker.tasks`): every worker runs it on each shard held, and
each step is one compare-and-set or one locked batch, so two workers doing it at once do no
harm.

Reaping (:func:`vigil.ledger.tasks.reap`): a task past its deadline ends ``timed_out``; one
whose heartbeat is older than ``VIGIL_TASK_STALE_S`` is taken back (queued again, or ``lost``
with the reason after ``VIGIL_TASK_MAX_ATTEMPTS``), and the next claim fences its old holder
out for good.

Reporting: a terminal task becomes one event for its user, source ``task``, source id the
task id (the dedup key), produced and acknowledged before ``reported_at`` is committed. A
crash in between produces it again and the ledger drops the copy: one result event per task,
which wakes the delegating session with the result. A memory review's result produces no
event (it wakes nobody). The executor wakes the reporter through :meth:`TaskUpkeep.wake_report`
when an outcome of its own stands.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from datetime import datetime
from typing import Any

import psycopg

from vigil.bus.kafka import EventProducer
from vigil.clock import Clock, utc
from vigil.envelope import Event
from vigil.ledger import tasks as ledger
from vigil.ledger.db import AsyncPool
from vigil.ledger.dreams import REVIEW
from vigil.ledger.states import TaskStatus
from vigil.worker import metrics
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import Shards

log = logging.getLogger(__name__)

TASK_SOURCE = "task"
# How often the reporter looks when nobody woke it.
POLL_S = 1.0
REPORT_BATCH = 100


def result_event(task: ledger.TaskRow, received_at: datetime) -> Event:
    """The one event a terminal task produces: keyed by its id, resuming the delegating session.
    ``received_at``: now on the reporting worker's clock."""
    body = {
        "task_id": task.id,
        "status": str(task.status),
        "instructions": task.instructions[:500],
        "result": task.result,
        "error": task.error,
        "attempts": task.attempts,
        "usage": {"turns": task.turns, "input_tokens": task.input_tokens, "output_tokens": task.output_tokens},
    }
    return Event(
        user_id=task.user_id,
        source=TASK_SOURCE,
        source_id=task.id,
        kind=f"task.{task.status}",
        payload=json.dumps(body, separators=(",", ":")),
        received_at=received_at,
        occurred_at=task.finished_at,
        session_id=task.session_id,
    )


class TaskUpkeep:
    """The reaper, the reporter and the gauges, on every shard held."""

    def __init__(self, settings: WorkerSettings, shards: Shards, producer: EventProducer, clock: Clock):
        self.settings = settings
        self.shards = shards
        self.producer = producer
        self.clock = clock  # the reaper's now and the result events' received_at
        self._wake_report = asyncio.Event()
        self._stopping = False

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run for as long as the worker does."""
        return [self.reap_loop(), self.report_loop(), self.gauge_loop()]

    def wake_report(self) -> None:
        """A task reached a terminal status: report it now, not at the next poll."""
        self._wake_report.set()

    def stop(self) -> None:
        """Each loop ends at its next turn (the worker is shutting down)."""
        self._stopping = True

    async def reap_loop(self) -> None:
        while not self._stopping:
            reaped = []
            for shard, pool in self.shards.opened():
                try:
                    async with pool.connection() as conn:
                        reaped += await ledger.reap(conn, self.settings.task_stale_s, now=utc(self.clock.now()))
                except (psycopg.Error, OSError) as exc:
                    log.warning("task reaper failed (ledger shard %d), retrying: %s", shard, exc)
            for r in reaped:
                metrics.TASKS_REAPED.labels(str(r.status)).inc()
                if r.status != TaskStatus.QUEUED:
                    metrics.TASKS.labels(str(r.status)).inc()
                log.warning("task %s reaped: now %s", r.id, r.status)
            if any(r.status != TaskStatus.QUEUED for r in reaped):
                self._wake_report.set()
            await asyncio.sleep(self.settings.task_heartbeat_s)

    async def report_loop(self) -> None:
        while not self._stopping:
            try:
                sent = await self.report_once()
            except (psycopg.Error, OSError) as exc:
                log.warning("task reporter failed, retrying: %s", exc)
                sent = 0
            except Exception as exc:  # a produce failure: the rows stay unreported
                log.warning("task results not produced, retrying: %s", exc)
                sent = 0
            if sent == REPORT_BATCH:
                continue
            self._wake_report.clear()
            try:
                await asyncio.wait_for(self._wake_report.wait(), POLL_S)
            except TimeoutError:
                pass

    async def report_once(self) -> int:
        """Lock unreported terminal tasks, produce their events (acknowledged), mark, commit:
        on each shard held, a transaction each; how many were reported (at most REPORT_BATCH
        on one shard: another round comes at once)."""
        most = 0
        for _shard, pool in self.shards.opened():
            most = max(most, await self._report(pool))
        return most

    async def _report(self, pool: AsyncPool) -> int:
        async with pool.connection() as conn:
            async with conn.transaction():
                rows = await ledger.unreported(conn, REPORT_BATCH)
                if not rows:
                    return 0
                # A memory review's outcome wakes nobody: it is on its row and in memory_history.
                now = utc(self.clock.now())
                events = [result_event(row, now) for row in rows if row.kind != REVIEW]
                if events:
                    await asyncio.to_thread(self.producer.send, events)
                await ledger.mark_reported(conn, [row.id for row in rows])
        metrics.TASK_RESULTS_REPORTED.inc(len(rows))
        return len(rows)

    async def gauge_loop(self) -> None:
        while not self._stopping:
            try:
                queued, running, age_s = 0, 0, 0.0
                for _shard, pool in self.shards.opened():
                    async with pool.connection() as conn:
                        g = await ledger.gauges(conn)
                    queued, running = queued + g.queued, running + g.running
                    age_s = max(age_s, g.heartbeat_age_s)
                metrics.TASKS_QUEUED.set(queued)
                metrics.TASKS_RUNNING.set(running)
                metrics.TASK_HEARTBEAT_AGE.set(age_s)
            except (psycopg.Error, OSError):
                pass
            await asyncio.sleep(max(self.settings.task_heartbeat_s, 5.0))
