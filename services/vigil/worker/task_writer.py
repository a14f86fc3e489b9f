"""A held background task's end, written to the ledger: its outcome, or its hand-back.

The outcome (``succeeded``, ``failed``, ``timed_out`` at the task's deadline, ``cancelled``)
is written by :func:`vigil.ledger.tasks.finish`, a compare-and-set on the lease epoch: if
another terminal outcome got there first (a timeout, a cancel, a reaper), this one is
dropped. A task its holder stops without an outcome (shutting down, or a lone attempt's
drain) is handed back by :func:`vigil.ledger.tasks.release`, the attempt not counted.
The executor (:mod:`vigil.worker.tasks`) decides which; this module only writes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import psycopg

from vigil.agent.base import MemoryWrite, NewTask, TaskContext
from vigil.agent.journal import task_key
from vigil.clock import Clock, utc
from vigil.ledger import finish as ledger_finish
from vigil.ledger import journal as ledger_journal
from vigil.ledger import tasks as ledger
from vigil.ledger.db import AsyncPool
from vigil.ledger.states import TaskStatus
from vigil.retry import backoff
from vigil.worker.finish import new_task_row
from vigil.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# A holder's outcome refused by a ledger error is written again after backoff(attempt, these).
WRITE_RETRY_BASE_S = 0.2
WRITE_RETRY_CAP_S = 5.0


def with_usage(
    ctx: TaskContext, status: TaskStatus, result: str | None = None, error: str | None = None
) -> ledger.Outcome:
    """The outcome ``status``, with the usage the execution has spent so far."""
    u = ctx.usage
    return ledger.Outcome(status, result, error, u.turns, u.input_tokens, u.output_tokens)


class TaskWriter:
    """Writes what its holder decided; ``pool_of(task)`` is the pool of the shard ``task`` was
    claimed on (the executor's to know)."""

    def __init__(self, settings: WorkerSettings, clock: Clock, pool_of: Callable[[ledger.TaskRow], AsyncPool]):
        self.settings = settings
        self.clock = clock  # the retries' give-up and the delegated tasks' creation time
        self._pool = pool_of

    async def write(
        self,
        task: ledger.TaskRow,
        outcome: ledger.Outcome,
        spawned: Sequence[NewTask] = (),
        writes: Sequence[MemoryWrite] = (),
    ) -> bool | None:
        """The compare-and-set, with the background tasks the task delegated (``spawned``,
        given only for a success) queued in the same transaction if it stands, as a run's
        finish queues its tasks: their usage is rolled up to the task's run; and a memory
        review's ``writes`` (given only for a success), each audited in ``memory_history`` with
        the task's id. Retried through ledger errors with :func:`vigil.retry.backoff`
        (from ``WRITE_RETRY_BASE_S``, jittered, capped) for at most ``VIGIL_TASK_STALE_S``: by
        then no heartbeat has kept the lease (the execution has ended), the reaper may have
        taken the task back, and the task is left to it (queued again, replaying its journal,
        or lost). True: it stands; False: another outcome did; None: given up."""
        give_up = self.clock.monotonic() + self.settings.task_stale_s
        attempt = 0
        while True:
            try:
                async with self._pool(task).connection() as conn, conn.transaction():
                    stands = await ledger.finish(conn, task.id, task.lease_epoch, outcome)
                    if stands:
                        for child in spawned:
                            profile = (
                                (task.profile, task.profile_version) if task.profile and task.profile_version else None
                            )
                            row = new_task_row(task.user_id, child, task.run_id, profile)
                            await ledger.create(conn, row, now=utc(self.clock.now()))
                        for write in writes:
                            await ledger_finish.write_memory(
                                conn,
                                user_id=task.user_id,
                                path=write.path,
                                content=write.content,
                                run_id=None,
                                task_id=task.id,
                            )
                        await ledger_journal.finish_task(
                            conn,
                            task_key(task.id, task.lease_epoch, journaled=True),
                            keep=self.settings.run_journal_days > 0,
                        )
                    return stands
            except (psycopg.Error, OSError) as exc:
                attempt += 1
                pause = backoff(attempt, WRITE_RETRY_BASE_S, WRITE_RETRY_CAP_S)
                if self.clock.monotonic() + pause > give_up:
                    log.warning(
                        "task %s: outcome %s not written after %d attempts; left to the reaper: %s",
                        task.id,
                        outcome.status,
                        attempt,
                        exc,
                        extra={"event": "task_outcome_abandoned"},
                    )
                    return None
                log.warning(
                    "task %s: writing its outcome failed (attempt %d), retrying in %.2f s: %s",
                    task.id,
                    attempt,
                    pause,
                    exc,
                )
                await asyncio.sleep(pause)

    async def release(self, task: ledger.TaskRow) -> None:
        try:
            async with self._pool(task).connection() as conn:
                released = await ledger.release(conn, task.id, task.lease_epoch)
        except (psycopg.Error, OSError) as exc:
            log.warning("task %s: could not hand it back (the reaper will): %s", task.id, exc)
            return
        if released:
            log.info("task %s handed back for another worker (shutting down)", task.id)
