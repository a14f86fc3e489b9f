"""Background tasks: executing them, reaping them, and reporting their results as events.

Any worker executes any user's tasks: a task does not touch the user's conversation, so it
is not bound by the one-run-per-user rule, and it is claimed from the ``tasks`` table, not
from a partition. The task row is the one authority over its life (docs/tasks.md); this
module only ever changes it through :mod:`vigil.ledger.tasks`, one compare-and-set each.

Executing one task, in order:

1. :func:`vigil.ledger.tasks.claim` takes it under a new lease epoch (an attempt counted).
2. The agent's ``run_task`` executes it while a heartbeat every ``VIGIL_TASK_HEARTBEAT_S``
   proves this worker alive. A heartbeat that matches nothing means the lease is gone (the
   reaper took the task back, or it timed out): the execution is cancelled and nothing of
   it is written. A heartbeat that sees a cancel request stops the execution and records
   ``cancelled`` with the usage spent so far. A holder none of whose heartbeats got through
   for ``VIGIL_TASK_STALE_S / 2`` stops the execution itself and writes nothing: it has
   stopped before the reaper may hand the task to anyone else.
3. The outcome (``succeeded``, ``failed``, ``timed_out`` at the task's deadline) is written
   by :func:`vigil.ledger.tasks.finish`, a compare-and-set on the lease epoch: if another
   terminal outcome got there first (a timeout, a cancel, a reaper), this one is dropped
   (:mod:`vigil.worker.task_writer`).

A crash anywhere leaves the task ``running`` with a heartbeat that stops growing; the reaper
(every worker runs one: :mod:`vigil.worker.task_upkeep`) takes it back after
``VIGIL_TASK_STALE_S`` and the next claim fences this holder out for good. A holder alive but
cut off from the ledger has stopped itself by then (step 2). So no two holders act at once,
none is silently re-created, and a task whose holders keep dying ends ``lost``, with the
reason, after ``VIGIL_TASK_MAX_ATTEMPTS``.

Reporting: a terminal task becomes one event for its user, which wakes the delegating
session with the result (:mod:`vigil.worker.task_upkeep`, which this executor wakes through
``wake_report`` when an outcome of its own stands).

A memory review (``kind`` memory_review, queued by the scheduler: docs/agent.md, "Dreaming")
is executed the same way, given the user's memory files at the start; its memory writes are
stored in the transaction of its outcome, only if that outcome stands, and its result
produces no event (it wakes nobody).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import psycopg

from vigil.agent.base import Agent, Delegation, TaskContext, TaskResult, TaskUsage
from vigil.agent.journal import Journal, task_key
from vigil.clock import Clock, SystemClock, utc
from vigil.ledger import agent as ledger_agent
from vigil.ledger import journal as ledger_journal
from vigil.ledger import tasks as ledger
from vigil.ledger.db import AsyncPool
from vigil.ledger.dreams import REVIEW
from vigil.ledger.states import TaskStatus
from vigil.worker import metrics
from vigil.worker.journal import FencedWriter, open_journal
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import CATALOG, Shards
from vigil.worker.task_writer import TaskWriter, with_usage

log = logging.getLogger(__name__)

# How often the claim loop looks again when it has no room, or claimed all there was.
POLL_S = 1.0
# What _supervise returns for an execution this worker stopped because it is shutting down.
RELEASE = object()
# What _supervise returns for an execution its holder stopped because the ledger did not take
# its heartbeats for VIGIL_TASK_STALE_S / 2 (settings.task_fence_s).
FENCED = object()


async def open_task_journal(pool: AsyncPool, task: ledger.TaskRow, *, journaled: bool) -> Journal:
    """The journal a holder of ``task`` (under its lease) runs it with. Journaled: ``task:<id>``,
    its steps read back (what an earlier holder did is replayed, not done again) and appended
    fenced by the lease. Without a journal (VIGIL_RUN_JOURNAL=false) nothing is read or
    written, and the holder asks the model again and may make other calls at the same steps,
    so its keys are its own (``task:<id>~<lease epoch>:<step>``). The ledger's model opens a
    task's journal through this too (tests/test_ledger_model.py)."""
    if not journaled:
        return open_journal(task_key(task.id, task.lease_epoch, journaled=False), None)
    key = task_key(task.id, task.lease_epoch, journaled=True)
    async with pool.connection() as conn:
        steps = await ledger_journal.live_task(conn, key)
    writer = FencedWriter(pool, ledger_journal.TaskFence(task.id, task.lease_epoch), key)
    return open_journal(key, writer, steps)


@dataclass(slots=True)
class Holding:
    task: ledger.TaskRow
    ctx: TaskContext
    leased_at: float  # the clock's monotonic() before the claim was sent: the lease is at least this fresh
    execution: asyncio.Task[TaskResult] | None = None
    handed_back: bool = False  # cancelled to be handed back (a lone attempt's drain), not failed


class TaskExecutor:
    """The tasks this process holds: claiming, executing, and deciding each one's end.
    ``wake_report`` is called when an outcome of its own stands (the reporter's wake-up,
    :meth:`vigil.worker.task_upkeep.TaskUpkeep.wake_report`)."""

    def __init__(
        self,
        settings: WorkerSettings,
        agent: Agent,
        pool: AsyncPool | Shards,
        clock: Clock | None = None,
        wake_report: Callable[[], None] = lambda: None,
    ):
        self.settings = settings
        self.agent = agent
        self.shards = Shards.of(pool)  # tasks are claimed on every shard held, each run on its own
        # Every decision of a holder is on this clock: the task's deadline (in the ledger too),
        # its heartbeat period, its self-fence, the retries of its outcome, the stop's grace.
        # Leases are judged on the ledger's clock alone (it stamps the heartbeats and judges
        # their age), so no host's skew enters them.
        self.clock = clock or SystemClock()
        self.holding: dict[str, Holding] = {}
        self._shard_of: dict[str, int] = {}  # a held task's shard, from its claim to its last write
        self._wake_report = wake_report
        self._writer = TaskWriter(settings, self.clock, self._pool)
        self._stopping = False
        # Set by the worker: while it says so, nothing is claimed (a lost event's last attempt
        # runs with nothing else in flight in this process, tasks included: claim rule 3).
        self.hold_off: Callable[[], bool] | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.task_concurrency > 0 and hasattr(self.agent, "run_task")

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """The coroutines to run for as long as the worker does (the claim loop, if tasks are
        executed here at all)."""
        return [self.claim_loop()] if self.enabled else []

    # -- claiming and executing -----------------------------------------------------------

    async def claim_loop(self) -> None:
        while not self._stopping:
            free = self.settings.task_concurrency - len(self.holding)
            if self.hold_off is not None and self.hold_off():
                free = 0
            if free > 0:
                left = free
                for shard, pool in self.shards.opened():
                    if left <= 0:
                        break
                    sent = self.clock.monotonic()
                    try:
                        async with pool.connection() as conn:
                            claimed = await ledger.claim(
                                conn, self.settings.instance_id, left, now=utc(self.clock.now())
                            )
                    except (psycopg.Error, OSError) as exc:
                        log.warning("task claim failed (ledger shard %d), retrying: %s", shard, exc)
                        claimed = []
                    for task in claimed:
                        self._start(task, sent, shard)
                    left -= len(claimed)
                if left <= 0:
                    continue  # there may be more
            await asyncio.sleep(POLL_S)

    def _pool(self, task: ledger.TaskRow) -> AsyncPool:
        """The pool of the shard ``task`` was claimed on."""
        return self.shards.pool(self._shard_of.get(task.id, CATALOG))

    def _start(self, task: ledger.TaskRow, leased_at: float, shard: int = CATALOG) -> None:
        # The agent checks its deadline against the host's monotonic clock (as a run's); the
        # holder decides the timeout itself, on its clock (_supervise).
        deadline_s = (task.deadline - utc(self.clock.now())).total_seconds()  # set on a caller's clock
        ctx = TaskContext(
            task_id=task.id,
            user_id=task.user_id,
            instructions=task.instructions,
            tools=tuple(task.tools),
            token_budget=task.token_budget,
            deadline=time.monotonic() + max(deadline_s, 0.0),
            delegation=Delegation(
                depth=task.depth,
                max_depth=self.settings.max_delegation_depth,
                token_budget=self.settings.task_token_budget,
                timeout_s=self.settings.task_timeout_s,
                max_attempts=self.settings.task_max_attempts,
                owner_chain=(*task.owner_chain, task.id),
                max_tasks_per_run=self.settings.max_tasks_per_run,
                max_open_tasks_per_user=self.settings.max_open_tasks_per_user,
            ),
            attempt=task.attempts,
            lease_epoch=task.lease_epoch,
            tasks=self.shards.task_door(shard),
            session_id=task.session_id,
            kind=task.kind,
            profile=(task.profile, task.profile_version)
            if task.profile is not None and task.profile_version is not None
            else None,
        )
        holding = Holding(task, ctx, leased_at)
        self.holding[task.id] = holding
        self._shard_of[task.id] = shard
        metrics.TASKS_IN_FLIGHT.set(len(self.holding))
        asyncio.create_task(self._hold(holding), name=f"task-{task.id}")
        log.info(
            "task %s claimed (attempt %d of %d, lease %d)", task.id, task.attempts, task.max_attempts, task.lease_epoch
        )

    async def _hold(self, holding: Holding) -> None:
        """Execute one task under its lease; write its outcome unless the lease was lost."""
        try:
            await self._held(holding)
        finally:
            self._shard_of.pop(holding.task.id, None)

    async def _held(self, holding: Holding) -> None:
        task, ctx = holding.task, holding.ctx
        started = time.monotonic()  # a measurement, not a decision: the host's clock
        if not await self._journal(holding) or not await self._memory(holding):
            self.holding.pop(task.id, None)
            metrics.TASKS_IN_FLIGHT.set(len(self.holding))
            await self._writer.release(task)
            return
        holding.execution = asyncio.create_task(self.agent.run_task(ctx), name=f"task-run-{task.id}")
        outcome: ledger.Outcome | object | None = None
        try:
            outcome = await self._supervise(holding)
        finally:
            if not holding.execution.done():
                holding.execution.cancel()
                await asyncio.gather(holding.execution, return_exceptions=True)
            self.holding.pop(task.id, None)
            metrics.TASKS_IN_FLIGHT.set(len(self.holding))
        if outcome is RELEASE:
            await self._writer.release(task)
            return
        if outcome is FENCED:
            metrics.TASK_SELF_FENCED.inc()
            log.warning(
                "task %s: no heartbeat got through for %.1f s; stopped executing, nothing written "
                "(the reaper may take it back after %.1f s)",
                task.id,
                self.settings.task_fence_s,
                self.settings.task_stale_s,
                extra={"event": "task_self_fenced"},
            )
            return
        if outcome is None:
            metrics.TASK_LEASES_LOST.inc()
            log.warning(
                "task %s: lease %d lost (taken back or timed out); its outcome is not written",
                task.id,
                task.lease_epoch,
            )
            return
        assert isinstance(outcome, ledger.Outcome)
        succeeded = outcome.status is TaskStatus.SUCCEEDED
        writes = holding.execution.result().memory_writes if succeeded else []
        stands = await self._writer.write(task, outcome, ctx.spawned if succeeded else [], writes)
        if stands is None:
            return
        if stands:
            metrics.TASKS.labels(str(outcome.status)).inc()
            metrics.TASK_SECONDS.observe(time.monotonic() - started)
            self._wake_report()
        else:
            metrics.TASK_LATE_OUTCOMES.inc()
            log.warning("task %s: outcome %s refused, another one stood first", task.id, outcome.status)

    async def _journal(self, holding: Holding) -> bool:
        """The task's journal (``task:<id>``, fenced by its lease): what an earlier holder did
        is replayed, not done again (vigil.worker.journal). False if it cannot be read: the
        task is handed back rather than run blind."""
        task, ctx = holding.task, holding.ctx
        try:
            ctx.journal = await open_task_journal(self._pool(task), task, journaled=self.settings.run_journal)
        except (psycopg.Error, OSError) as exc:
            log.warning("task %s: could not read its journal, handing it back: %s", task.id, exc)
            return False
        if ctx.journal.recorded:
            log.info("task %s: replaying its journal (%d steps)", task.id, len(ctx.journal.recorded))
        return True

    async def _memory(self, holding: Holding) -> bool:
        """A memory review starts from the user's files as they are now. False if they cannot
        be read: the task is handed back rather than reviewed blind."""
        task = holding.task
        if task.kind != REVIEW:
            return True
        try:
            async with self._pool(task).connection() as conn:
                holding.ctx.memory = await ledger_agent.memory_of(conn, task.user_id)
        except (psycopg.Error, OSError) as exc:
            log.warning("task %s: could not read the memory to review, handing it back: %s", task.id, exc)
            return False
        return True

    async def _supervise(self, holding: Holding) -> ledger.Outcome | object | None:
        """Heartbeats until the execution ends. Returns the outcome; None if the lease is gone;
        FENCED if no heartbeat got through for ``task_fence_s`` (the holder must stop before the
        reaper, which waits ``task_stale_s`` from the last heartbeat the ledger took, may hand the
        task to another worker). A heartbeat runs beside the execution, never awaited past the
        fence: a ledger that stops answering cannot hold this loop."""
        task, ctx, execution = holding.task, holding.ctx, holding.execution
        assert execution is not None
        fence_s, period = self.settings.task_fence_s, self.settings.task_heartbeat_s
        fence_at = holding.leased_at + fence_s  # the claim itself was the first heartbeat
        next_beat = self.clock.monotonic() + period
        deadline = task.deadline.timestamp()  # wall time, set on a caller's clock: judged on ours
        beat: asyncio.Task[bool | None] | None = None
        beat_sent = 0.0
        try:
            while True:
                now = self.clock.monotonic()
                left_s = deadline - self.clock.now()
                if left_s <= 0:
                    return with_usage(ctx, TaskStatus.TIMED_OUT, error="deadline passed while it ran")
                if now >= fence_at:
                    return FENCED
                if beat is None and now >= next_beat:
                    beat_sent, next_beat = now, now + period
                    beat = asyncio.create_task(self._beat(task, ctx.usage), name=f"task-beat-{task.id}")
                wake_s = min(left_s, fence_at - now, (next_beat if beat is None else fence_at) - now)
                waiting = {execution} if beat is None else {execution, beat}
                done, _ = await asyncio.wait(waiting, timeout=max(wake_s, 0.0), return_when=asyncio.FIRST_COMPLETED)
                if execution in done:
                    return self._outcome(holding)
                if beat is None or not beat.done():
                    continue
                finished, beat = beat, None
                if finished.exception() is not None:
                    log.warning("task %s: heartbeat failed: %s", task.id, finished.exception())
                    continue
                answer = finished.result()
                if answer is None:
                    return None
                if answer:
                    return with_usage(ctx, TaskStatus.CANCELLED, error="cancelled by its owner while it ran")
                fence_at = beat_sent + fence_s
        finally:
            if beat is not None:
                beat.cancel()

    async def _beat(self, task: ledger.TaskRow, usage: TaskUsage) -> bool | None:
        progress = ledger.Progress(usage.turns, usage.input_tokens, usage.output_tokens, usage.last_tool, usage.note)
        async with self._pool(task).connection() as conn:
            return await ledger.heartbeat(conn, task.id, task.lease_epoch, progress)

    def _outcome(self, holding: Holding) -> ledger.Outcome | object:
        execution, ctx = holding.execution, holding.ctx
        assert execution is not None
        if execution.cancelled() and (self._stopping or holding.handed_back):
            return RELEASE
        if execution.cancelled():
            return with_usage(ctx, TaskStatus.FAILED, error="execution cancelled")
        exc = execution.exception()
        if exc is not None:
            return with_usage(ctx, TaskStatus.FAILED, error=f"{type(exc).__name__}: {exc}"[:2000])
        return with_usage(ctx, TaskStatus.SUCCEEDED, result=execution.result().text)

    def busy(self) -> int:
        """Tasks this process holds."""
        return len(self.holding)

    def hand_back(self) -> int:
        """Cancel every execution in flight and hand its task back to the queue, the attempt
        not counted (as at shutdown); returns how many."""
        count = 0
        for holding in list(self.holding.values()):
            holding.handed_back = True
            if holding.execution is not None and not holding.execution.done():
                holding.execution.cancel()
                count += 1
        return count

    async def stop(self, grace_s: float) -> None:
        """Stop claiming; give executions ``grace_s`` to end; hand the rest back to the queue."""
        self._stopping = True
        deadline = self.clock.monotonic() + grace_s
        while self.holding and self.clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for holding in list(self.holding.values()):
            if holding.execution is not None:
                holding.execution.cancel()
        deadline = self.clock.monotonic() + 5.0
        while self.holding and self.clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
