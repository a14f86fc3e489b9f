"""Running: the runs in flight, their context, the agent's execution (docs/worker.md, "Running").

:class:`Runs` holds every run this process has claimed and not yet committed
(``active``, one per user, claim rule 4), starts each on its own asyncio task, loads its
context (:mod:`vigil.agent.run_ledger`; a claim pass's runs together, :meth:`Runs.preload`),
runs the agent under ``VIGIL_RUN_TIMEOUT_S`` and hands the outcome, a result or an error
with its backoff, to ``finish`` (the queue of :class:`vigil.worker.finish_loop.Finisher`). A run
leaves ``active`` only when its finish is committed (or it is cancelled and released), so
the claim pass never claims a user twice. When to claim is :mod:`vigil.worker.claim_loop`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import psycopg
from psycopg.rows import DictRow

from vigil import logs
from vigil.agent.base import Agent, OverBudget, RetryLater, RunContext
from vigil.agent.journal import HandedOver
from vigil.clock import Clock, utc
from vigil.ledger import claims as ledger_claims
from vigil.ledger.claims import Claim
from vigil.ledger.db import AsyncPool, is_outage
from vigil.ledger.events import EventRow
from vigil.ledger.journal import Fenced
from vigil.ledger.partitions import PartitionKey
from vigil.retry import backoff
from vigil.service import first_line
from vigil.worker import journal as run_journal
from vigil.worker import metrics, traces
from vigil.worker.contexts import Contexts
from vigil.worker.finish import Finished, stopped_by_budget
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import Shards

log = logging.getLogger(__name__)

GONE_POLL_S = 0.01  # how often wait_gone looks whether the finisher has committed


@dataclass(slots=True)
class Active:
    claim: Claim
    task: asyncio.Task[None] | None = None
    folded: list[EventRow] = field(default_factory=list)
    alone: bool = False  # a lost event's last attempt: nothing else runs beside it
    ctx: RunContext | None = None  # loaded with its claim pass; None: the run loads its own
    handing_over: bool = False  # stop at the next step boundary (VIGIL_HANDOVER=step)
    handed_over: bool = False  # ... and it did: released for the next owner to replay


class Runs:
    """The runs in flight and their execution; ``finish`` hands outcomes to the finish loop."""

    def __init__(
        self,
        settings: WorkerSettings,
        agent: Agent,
        pool: AsyncPool | Shards | None,
        clock: Clock,
        finish: Callable[[Finished], None] | None = None,
    ) -> None:
        self.settings = settings
        self.agent = agent
        # A run's ledger work goes to the shard of its claim's home partition (where it was
        # claimed): its context, journal, folds, tasks, release (and its finish, Finisher).
        self.shards = Shards.of(pool)  # type: ignore[arg-type]  # None: tests that touch no ledger
        self.clock = clock
        self.contexts = Contexts(settings, agent, self.shards, clock)  # what each run reads before it runs
        self.active: dict[str, Active] = {}
        self.journal_groups: dict[int, run_journal.GroupAppend] = {}  # per shard: its runs' appends, grouped
        self.finish = finish or _no_finish  # the finish loop's queue (Finisher.put); None: tests that run no agent
        # The partitions whose runs a revoke waits for (:meth:`wait_gone`): a finish group
        # holding one of their runs does not wait for company (finish_loop.gather_s), and
        # ``hurry`` wakes a group already waiting when the revoke starts or when one of those
        # runs is queued. Other partitions' groups go on gathering.
        self.hurry = asyncio.Event()
        self._hurrying: Counter[PartitionKey] = Counter()
        self._giving_back: set[asyncio.Task[None]] = set()  # lost partitions' claims (:meth:`cancel`)

    @property
    def needs_context(self) -> bool:
        """False for an agent that reads no session, memory or messages (the echo agent)."""
        return self.contexts.needs_context

    async def preload(self, conn: psycopg.AsyncConnection[DictRow], started: list[Active]) -> None:
        """The contexts of a pass's runs, read together (:meth:`Contexts.preload`); if that
        fails, each run reads its own."""
        ctxs = await self.contexts.preload(conn, [(active.claim, active.folded) for active in started])
        if ctxs is not None:
            for active, ctx in zip(started, ctxs, strict=True):
                active.ctx = ctx

    def start(self, active: Active) -> None:
        """Hold ``active`` as this user's run and start it on its own task."""
        c = active.claim
        self.active[c.user_id] = active
        # The task copies the context: every line the run logs names its user, claim and run
        # (and its trace, when traces are on: traces.run puts the run under its span).
        with logs.context(
            user_id=c.user_id, event_id=c.events[0].id, partition=c.home.partition, epoch=c.epoch, run_id=c.run_key
        ):
            active.task = asyncio.create_task(
                traces.run(self._run(active), c, self.pool_of(c)), name=f"run-{c.user_id}"
            )

    def pool_of(self, claim: Claim) -> AsyncPool:
        """The pool of the shard ``claim`` was made on: its home partition's."""
        return self.shards.pool_of(claim.home.partition)

    def _journal_group(self, claim: Claim) -> run_journal.GroupAppend:
        shard = self.shards.shard_of(claim.home.partition)
        group = self.journal_groups.get(shard)
        if group is None:
            group = self.journal_groups[shard] = run_journal.GroupAppend(self.shards.pool(shard))
        return group

    def forget(self, claim: Claim) -> None:
        """The run of ``claim`` has left (its finish committed or refused): free its user's slot,
        unless the slot is already another run's (the partition went and came back meanwhile)."""
        active = self.active.get(claim.user_id)
        if active is not None and active.claim is claim:
            del self.active[claim.user_id]

    async def wait_gone(self, victims: list[Active], within_s: float) -> list[Active]:
        """Wait, at most ``within_s``, until ``victims`` have left (their finish committed or
        refused); returns those still here. Meanwhile finish groups do not wait for company
        (finish_loop.gather_s), so a run that has returned commits at once.

        A revoke's: runs of a revoked partition finish and commit under the epoch that is
        still ours (a partition is revoked before it is given to the next owner, and that
        owner's takeover waits for the revoke), instead of being released to run again."""
        if not victims or within_s <= 0:
            return victims
        homes = Counter({a.claim.home for a in victims})
        self._hurrying.update(homes)
        self.hurry.set()
        try:
            deadline = time.monotonic() + within_s  # the revoke's grace, as the consumer measures it
            while any(self.active.get(a.claim.user_id) is a for a in victims) and time.monotonic() < deadline:
                await asyncio.sleep(GONE_POLL_S)
        finally:
            self._hurrying.subtract(homes)
            self._hurrying = +self._hurrying  # drop the partitions no revoke waits for any more
        return [a for a in victims if self.active.get(a.claim.user_id) is a]

    def stop_at_boundary(self, victims: list[Active]) -> None:
        """VIGIL_HANDOVER=step: ``victims`` stop at their next step boundary and leave (their
        claims released for the next owner, who replays them); they are gone once their model
        answer in flight is journaled, instead of after their whole run."""
        if self.contexts.journaled and self.settings.handover == "step":
            for active in victims:
                active.handing_over = True

    def urgent(self, group: list[Finished]) -> bool:
        """Whether a revoke waits for a run of ``group`` (it commits without waiting for company)."""
        return bool(self._hurrying) and any(f.claim.home in self._hurrying for f in group)

    async def cancel(self, victims: list[Active], release: bool = True) -> None:
        """Cancel these runs, forget them, and hand their claims back: ``release``, at once
        (the partitions are still ours); otherwise (lost) in the background, as the runs of a
        live worker that a takeover may have counted as crashed (:meth:`_give_back_lost`)."""
        tasks = [active.task for active in victims if active.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for active in victims:
            self.active.pop(active.claim.user_id, None)
        if not victims:
            return
        if release:
            await self._release(_claimed(victims))
        else:
            task = asyncio.create_task(self._give_back_lost(_claimed(victims)), name="give-back-lost")
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

    async def _release(self, groups: dict[tuple[PartitionKey, int], list[int]]) -> None:
        """One statement per partition and epoch for all the events of the runs cancelled
        (their claims and what they folded in). A statement per run was a transaction per run:
        a revoke holding 1,124 model-bound runs took 6 s, the worker recording nothing
        meanwhile."""
        try:
            for shard, some in self.shards.split(groups.items(), _group_partition).items():
                async with self.shards.pool(shard).connection() as conn:
                    for (home, epoch), ids in some:
                        metrics.RELEASED.inc(await ledger_claims.release_claim(conn, home, epoch, ids))
        except psycopg.Error as exc:
            log.warning("could not release %d claim(s) (the next owner recovers them): %s", len(groups), exc)

    async def _give_back_lost(self, groups: dict[tuple[PartitionKey, int], list[int]]) -> None:
        """The claims of runs cancelled because their partitions were lost, this worker alive:
        released if no one took the partitions over yet (fenced by the epoch); if a takeover
        came first and counted them lost with a crashed worker, forgiven (a lone last
        attempt's death waits VIGIL_KAFKA_SESSION_TIMEOUT_MS x 3 for this:
        :func:`vigil.ledger.claims.forgive_lost_claims`). Retried while the
        ledger is unreachable, until that wait is over: only a worker that never came back
        makes a lone attempt's loss a crash."""
        deadline = time.monotonic() + self.settings.lost_verdict_s
        while True:
            try:
                forgiven: list[int] = []
                for shard, some in self.shards.split(groups.items(), _group_partition).items():
                    async with self.shards.pool(shard).connection() as conn:
                        for (home, epoch), ids in some:
                            metrics.RELEASED.inc(await ledger_claims.release_claim(conn, home, epoch, ids))
                            now = utc(self.clock.now())
                            max_attempts = self.settings.max_attempts
                            forgiven += await ledger_claims.forgive_lost_claims(
                                conn, home, epoch, ids, max_attempts, now=now
                            )
                if forgiven:
                    metrics.LOST_FORGIVEN.inc(len(forgiven))
                    log.warning(
                        "lost partitions: %d claim(s) a takeover counted as lost with a crashed worker given back:"
                        " events %s",
                        len(forgiven),
                        ", ".join(map(str, forgiven)),
                        extra={"event": "lost_claims_forgiven"},
                    )
                return
            except psycopg.Error as exc:
                if time.monotonic() >= deadline:
                    log.warning("could not give back the claims of lost partitions (the next owner decides): %s", exc)
                    return
                await asyncio.sleep(1.0)

    async def _run(self, active: Active) -> None:
        """Load the context, run the agent, queue the outcome for the finisher. A crash here
        leaves the claim in the ledger for the heal or the next owner; cancellation leaves it
        to whoever cancelled (a revoke or the lone-attempt drain releases it)."""
        c = active.claim
        started = utc(self.clock.now())
        finished = Finished(c, started, folded=active.folded)
        try:
            ctx = active.ctx if active.ctx is not None else await self.contexts.load(c, active.folded)
            if self.contexts.journaled:
                pool = self.pool_of(c)
                opened = await run_journal.open_run(
                    pool,
                    c,
                    ctx,
                    max_attempts=self.settings.max_attempts,
                    reload=partial(self.contexts.reload, pool),
                    folded=active.folded,
                    stop=lambda: active.handing_over,
                    group=self._journal_group(c),
                )
                if opened.steps_back:
                    # The user's run in progress goes first, alone: this claim goes back unstarted,
                    # nothing counted (vigil.worker.journal).
                    await self._hand_back(active)
                    return
                finished.journaled = True
            # wait_for, not asyncio.timeout (one task fewer per run, about 2% of a model-bound
            # worker's CPU, tried in 06fb73f): on Python 3.11 a run whose agent has returned
            # when a revoke cancels it still completes here, and its finish is then refused as
            # stale; under asyncio.timeout that cancel won about one time in five, and
            # test_stale_epoch_finish_writes_nothing never saw the refusal it pins down.
            result = await asyncio.wait_for(self.agent.run(ctx), self.settings.run_timeout_s)
            finished.result = result
            finished.folded = active.folded
        except asyncio.CancelledError:
            raise  # revoked or shutting down: the claim is released by whoever cancelled
        except HandedOver:
            # A revoke or a shutdown stopped it between two steps: its claim goes back (the
            # attempt not counted) and the next owner replays it from the journal.
            metrics.HANDED_OVER.inc()
            await self._hand_back(active)
            return
        except Fenced as exc:
            # The partition moved on: its finish will be refused as stale, so nothing of the
            # run lands, and the next owner replays its journal.
            log.warning("run stopped: %s", exc)
            finished.error = f"fenced: {exc}"
        except OverBudget as exc:
            # Not started: its events wait for the next UTC day, no attempt of any kind counted.
            stopped_by_budget(finished, exc)
        except RetryLater as exc:
            self._transient(finished, f"model unavailable: {exc.reason}", exc.retry_after)
        except Exception as exc:
            if is_outage(exc):
                # The ledger lost under the run (a restart, a failover), not the event's fault:
                # like an overloaded model, the attempt goes back, and a lone last attempt is
                # tried again alone.
                log.warning("run stopped, the ledger lost under it (attempt given back): %s", first_line(exc))
                self._transient(finished, f"ledger unavailable: {first_line(exc)}", None)
            else:  # the agent failed: a counted attempt
                log.warning("run failed for a user (attempt %d): %s: %s", c.attempt, type(exc).__name__, exc)
                finished.error = f"{type(exc).__name__}: {exc}"
                finished.backoff_s = backoff(c.attempt, self.settings.backoff_base_s, self.settings.backoff_cap_s)
        self.finish(finished)
        if c.home in self._hurrying:
            self.hurry.set()  # a group waiting for company takes this run and commits now

    def _transient(self, finished: Finished, error: str, retry_after: float | None) -> None:
        """``finished`` failed for a reason not the event's: its attempt given back, a transient
        failure counted instead, until VIGIL_TRANSIENT_MAX_ATTEMPTS makes it a counted one."""
        failures = finished.claim.transient_failures + 1
        finished.error = error
        finished.transient = failures < self.settings.transient_max_attempts
        finished.backoff_s = backoff(
            failures, self.settings.backoff_base_s, self.settings.backoff_cap_s, retry_after_s=retry_after
        )

    async def _hand_back(self, active: Active) -> None:
        """``active`` leaves unfinished: its claim (and what it folded) released, the attempt not
        counted, for the next owner or the next pass to take up."""
        active.handed_over = True
        await self._release(_claimed([active]))
        if self.active.get(active.claim.user_id) is active:
            del self.active[active.claim.user_id]


def _no_finish(finished: Finished) -> None:
    raise RuntimeError(f"a run of {finished.claim.user_id} finished with no finish loop to take it")


def _claimed(victims: list[Active]) -> dict[tuple[PartitionKey, int], list[int]]:
    """The events of ``victims`` (their claims and what they folded in), by home and epoch."""
    groups: dict[tuple[PartitionKey, int], list[int]] = defaultdict(list)
    for active in victims:
        claim = active.claim
        groups[claim.home, claim.epoch] += claim.event_ids + [event.id for event in active.folded]
    return groups


def _group_partition(item: tuple[tuple[PartitionKey, int], list[int]]) -> int:
    return item[0][0].partition
