"""Finishing: the group finish loop and the backlog gauges (docs/worker.md, "Finishing").

:class:`Finisher` owns the finish queue: :class:`vigil.worker.runs.Runs` hands each run's
outcome to :meth:`Finisher.put`, and the loop commits them together with
:func:`vigil.worker.finish.commit_finished` (the fenced transaction, docs/architecture.md,
"The finish"), then frees their users' slots and calls ``wake`` for a claim pass: at once
for the slot, and when a failed run's backoff ends. A commit whose outcome is unknown calls
``on_commit_unknown`` (the claim loop then looks for orphaned claims). The two callbacks are
all it knows of the claim loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

import psycopg

from vigil.clock import Clock, utc
from vigil.ledger import events as ledger_events
from vigil.ledger.db import AsyncPool
from vigil.worker import metrics, traces
from vigil.worker.finish import Finished, commit_finished
from vigil.worker.runs import Active, Runs
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import Shards
from vigil.worker.wakeups import BACKOFF_SLACK_S, LEDGER_RETRY_S

log = logging.getLogger(__name__)

GAUGE_INTERVAL_S = 15.0
# A small group waits for company up to a hundredth of its first run's duration, at most
# 50 ms (gather_s); a group of this many or more commits at once.
FINISH_GATHER_SHARE = 0.01
FINISH_GATHER_MAX_S = 0.05
FINISH_GATHER_MIN_S = 0.001
FINISH_GATHER_MIN_GROUP = 20


def gather_s(group: int, ran_s: float) -> float:
    """How long a group of ``group`` finished runs waits for company before it commits, its
    first run having taken ``ran_s``: a hundredth of that, at most FINISH_GATHER_MAX_S; none
    for a group of FINISH_GATHER_MIN_GROUP or more, nor for runs under a tenth of a second.

    A group costs its transaction whatever its size (about 1 ms of the worker's CPU: the
    epochs' lock, the statements, five round trips). Runs that wait on a model for seconds
    finish one or two at a time, so most groups held one run (4.7 on average at 490 runs/s
    finishing, half of them alone); waiting a hundredth of a run's time costs that run
    nothing it can notice, and quick runs (the echo agent, latency-bound load) never wait.
    """
    if group >= FINISH_GATHER_MIN_GROUP:
        return 0.0
    wait_s = min(FINISH_GATHER_MAX_S, FINISH_GATHER_SHARE * ran_s)
    return wait_s if wait_s >= FINISH_GATHER_MIN_S else 0.0


class Finisher:
    """Group-commits finished runs; reports the ledger's backlog.

    ``wake(delay)`` asks for a claim pass within ``delay`` seconds (a slot freed: 0; a failed
    run's backoff: when it ends); ``on_commit_unknown()`` is called when a finish commit
    failed and may have landed (the claim loop heals at its next pass)."""

    def __init__(
        self,
        settings: WorkerSettings,
        pool: AsyncPool | Shards,
        runs: Runs,
        clock: Clock,
        *,
        wake: Callable[[float], None],
        on_commit_unknown: Callable[[], None],
    ) -> None:
        self.settings = settings
        self.shards = Shards.of(pool)  # a group's runs commit on their shards, a transaction each
        self.runs = runs
        self.clock = clock
        self.wake = wake
        self.on_commit_unknown = on_commit_unknown
        self.finished: asyncio.Queue[Finished] = asyncio.Queue()  # each run's outcome (put), until committed
        self.stopping = False
        self.committing = 0  # groups taken off the queue and not yet committed (VIGIL_FINISH_CONCURRENCY loops)
        self._groups: set[asyncio.Task[None]] = set()  # several shards: each shard's part of a group, committing
        self._died: BaseException | None = None  # such a part's error, raised by the loop

    @property
    def idle(self) -> bool:
        """Nothing waits to be committed and no group is being committed."""
        return self.finished.empty() and self.committing == 0

    @property
    def active(self) -> dict[str, Active]:
        return self.runs.active

    def put(self, finished: Finished) -> None:
        """A run's outcome, for a finish loop to commit (the queue is unbounded: this never waits)."""
        self.finished.put_nowait(finished)

    async def finish_loop(self) -> None:
        """Take up to ``VIGIL_FINISH_BATCH_MAX`` finished runs, commit them in one fenced
        transaction (retried until the ledger answers), then forget them and wake a pass.
        A crash before the commit leaves their claims for the heal or the next owner; after
        it, nothing to redo. A finished run leaves ``active`` here, after its commit, so its
        user is not claimed again before the ledger shows the run's outcome.

        ``VIGIL_FINISH_CONCURRENCY`` of these loops share the queue: each group is its own
        transaction over its own runs (one run per user), and they lock the partition rows
        ``FOR SHARE`` only, so groups never wait for each other; with two, one group's
        statements overlap the other's commit (a run waited for the group before its own)."""
        while True:
            batch = [await self.finished.get()]
            self.committing += 1
            try:
                self._take_queued(batch)
                ran_s = (utc(self.clock.now()) - batch[0].started_at).total_seconds()
                wait_s = gather_s(len(batch), ran_s)
                if wait_s > 0 and not self.runs.urgent(batch):
                    # A revoke waiting for one of these runs, or for one queued meanwhile,
                    # cuts the wait short (Runs.wait_gone).
                    self.runs.hurry.clear()
                    try:
                        await asyncio.wait_for(self.runs.hurry.wait(), wait_s)
                    except TimeoutError:
                        pass
                    self._take_queued(batch)
                if self.shards.single:
                    await self._commit(batch)
                else:
                    # Several shards: each shard's runs commit in a task of their own, so a
                    # shard that does not answer holds only its own runs, never this loop
                    # (a group all of one shard too: else the loops fill with a dead shard's).
                    for runs in self.shards.split(batch, _home_partition).values():
                        self._spawn(runs)
            finally:
                self.committing -= 1
            if self._died is not None:
                raise self._died

    def _spawn(self, runs: list[Finished]) -> None:
        self.committing += 1
        task = asyncio.create_task(self._commit(runs), name="finish-shard")
        self._groups.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._groups.discard(task)
            self.committing -= 1
            if not task.cancelled() and task.exception() is not None and self._died is None:
                self._died = task.exception()  # raised by the loop: the worker exits non-zero

        task.add_done_callback(done)

    def _take_queued(self, batch: list[Finished]) -> None:
        while len(batch) < self.settings.finish_batch_max and not self.finished.empty():
            batch.append(self.finished.get_nowait())

    async def _commit(self, batch: list[Finished]) -> None:
        """One group: the fenced commit on each shard of its runs (one transaction per shard),
        retried until the shard answers; then its runs leave."""
        began = time.monotonic()  # a measurement, not a decision: the host's clock
        began_ns = time.time_ns()
        committed: list[Finished] = []
        for shard, runs in self.shards.split(batch, _home_partition).items():
            committed += await self._commit_on(shard, runs)
        metrics.LEDGER_SECONDS.labels("finish").observe(time.monotonic() - began)
        traces.finish(batch, began_ns, committed)
        now = utc(self.clock.now())
        landed = {id(run) for run in committed}  # identity: runs are not values to compare
        outcomes: Counter[str] = Counter()  # one labels() and inc() per outcome and group, not per run
        for run in batch:
            self.runs.forget(run.claim)
            if run.error is not None and id(run) in landed:
                self.wake(run.backoff_s + BACKOFF_SLACK_S)  # its events are claimable again then
            if run.waiting and id(run) in landed:
                continue  # refused for its budget, never started: vigil_budget_exhausted_total counts it
            label = "retry_later" if run.transient else run.outcome.value
            outcomes[label if id(run) in landed else "stale"] += 1
            metrics.RUN_SECONDS.observe((now - run.started_at).total_seconds())
        for label, n in outcomes.items():
            metrics.RUNS.labels(label).inc(n)
        metrics.RUNS_IN_FLIGHT.set(len(self.active))
        self.wake(0.0)  # their slots are free

    async def _commit_on(self, shard: int, runs: list[Finished]) -> list[Finished]:
        """``runs`` (all claimed on ``shard``) committed there; those whose finish stood."""
        while True:
            try:
                async with self.shards.pool(shard).connection() as conn:
                    committed, _stale = await commit_finished(
                        conn,
                        runs,
                        self.settings.instance_id,
                        journal_keep=self.settings.run_journal_days > 0,
                        now=utc(self.clock.now()),
                    )
                return committed
            except (psycopg.Error, OSError) as exc:
                log.warning("finish commit failed, retrying: %s", exc)
                # Its outcome is unknown (the commit may have landed, or landed and then
                # been lost): once the ledger answers again, look for orphaned claims.
                self.on_commit_unknown()
                await asyncio.sleep(LEDGER_RETRY_S)

    async def gauge_loop(self) -> None:
        """The ledger-wide backlog gauges, every GAUGE_INTERVAL_S (a dashboard's cadence): of
        every shard this worker has a pool on (the oldest, the sum)."""
        while not self.stopping:
            try:
                age_s, waiting = 0.0, 0
                for _shard, pool in self.shards.opened():
                    async with pool.connection() as conn:
                        pending = await ledger_events.oldest_pending(conn)
                    age_s, waiting = max(age_s, pending.age_s), waiting + pending.pending
                metrics.OLDEST_PENDING.set(age_s)
                metrics.PENDING.set(waiting)
            except psycopg.Error:
                pass
            await asyncio.sleep(GAUGE_INTERVAL_S)


def _home_partition(run: Finished) -> int:
    return run.claim.home.partition
