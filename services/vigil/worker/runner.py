"""The run loop: claims from the ledger, runs the agent, group-commits the finishes.

Runs are driven from the ledger, not from the poll loop: the consumer thread only records
events and wakes this loop; a claim pass here picks whatever the claim rules allow for the
partitions this worker owns, each run executes on its own task, and a finisher task commits
finished runs together. A long run therefore never stalls polling. Passes come when asked
for (a batch window or a backoff ending, a free slot, a takeover) and every scan interval,
which finds what this process was not told about: events recorded by another worker's
consumer for a user whose home partition is ours, an operator's retry.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime

import psycopg

from vigil import logs
from vigil.agent.base import Agent, Delegation, RetryLater, RunContext
from vigil.clock import Clock, SystemClock, utc
from vigil.ledger import claims as ledger_claims
from vigil.ledger import events as ledger_events
from vigil.ledger import recovery as ledger_recovery
from vigil.ledger.db import AsyncPool
from vigil.worker import metrics, traces
from vigil.worker.claims import Claim, alone_due, claim, claim_alone, claim_more, mark_dead
from vigil.worker.fencing import PartitionKey
from vigil.worker.finish import Finished, backoff_seconds, commit_finished
from vigil.worker.run_inputs import RECENT_MESSAGES, load_context, load_many
from vigil.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# A ledger error in the loop is retried after this long: long enough not to hammer a
# database that is failing over, short enough that users barely notice.
LEDGER_RETRY_S = 1.0
# Requested passes closer together than this are one pass (the consumer asks after every batch).
TIMER_MERGE_S = 0.005
# A pass for a backoff's end comes this much after it (the ledger's clock decides, not ours).
BACKOFF_SLACK_S = 0.005
GAUGE_INTERVAL_S = 15.0


@dataclass(slots=True)
class Active:
    claim: Claim
    task: asyncio.Task | None = None
    folded: list = field(default_factory=list)
    alone: bool = False  # a lost event's last attempt: nothing else runs beside it
    ctx: RunContext | None = None  # loaded with its claim pass; None: the run loads its own


class Runner:
    def __init__(
        self,
        settings: WorkerSettings,
        agent: Agent,
        pool: AsyncPool,
        dead_letters,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.agent = agent
        self.pool = pool
        self.dead_letters = dead_letters
        self.owned: dict[PartitionKey, int] = {}
        self.active: dict[str, Active] = {}
        self.finished: asyncio.Queue[Finished] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._timers: list[float] = []  # monotonic times of requested passes (a heap)
        self._last_timer = 0.0
        self._pass_now = False
        self._next_scan = 0.0
        self._next_dead_check = 0.0
        self._next_heal = 0.0  # orphaned claims at our epochs: on assignment, then periodically
        self._alone_at: datetime | None = None  # when a last attempt that must run alone is due
        self._drain_until: float | None = None  # draining for it: when to release what still runs
        self._stopping = False
        self._claim_lock = asyncio.Lock()
        self._cursor = ""  # round-robin position among waiting users (see claims.claim)

    # -- called from the consumer thread (through the event loop) ------------------------

    def wake(self, delay: float = 0.0) -> None:
        """Schedule a claim pass no later than ``delay`` seconds from now.

        Every wake-up is kept until it is due (a pass in between does not cancel it): the
        consumer asks for one when the batch window of what it just recorded ends, the
        finisher when a failed run's backoff ends. Wake-ups a few milliseconds apart are
        merged. Work this process cannot know about (rows recorded by another worker's
        consumer, an operator's retry) is found by the pass every ``scan_interval_s``.
        """
        if delay <= 0:
            self._pass_now = True
        else:
            at = self.clock.monotonic() + delay
            if abs(self._last_timer - at) < TIMER_MERGE_S:
                return
            self._last_timer = at
            heapq.heappush(self._timers, at)
        self._wake.set()  # the loop recomputes when its next pass is due

    async def assign(self, epochs: dict[PartitionKey, int]) -> None:
        async with self._claim_lock:
            self.owned.update(epochs)
            self._next_dead_check = 0.0  # the takeover may have handed back exhausted claims
            self._next_heal = 0.0
        metrics.EPOCHS_HELD.set(len(self.owned))
        self.wake()
        # The takeover handed the previous owner's claims back with jittered backoffs: wake
        # when each ends, so they come back one by one as they did before this process
        # (a poison event among them then tends to run, and crash us, alone).
        keys = sorted(epochs)
        try:
            async with self.pool.connection() as conn:
                ends = await ledger_claims.backoff_ends(conn, keys)
        except psycopg.Error as exc:
            log.warning("could not read backoffs after a takeover (the periodic pass finds them): %s", exc)
            return
        now = utc(self.clock.now())
        for at in ends:
            self.wake((at - now).total_seconds() + BACKOFF_SLACK_S)

    async def revoke(self, keys: list[PartitionKey], release: bool = True) -> None:
        """Stop claiming for ``keys``; cancel their runs and hand their claims back.

        A release is fenced like a finish: if the new owner already took over, it matches
        nothing and the takeover's hand-back has done the job.
        """
        async with self._claim_lock:
            gone = {key: self.owned.pop(key) for key in keys if key in self.owned}
        metrics.EPOCHS_HELD.set(len(self.owned))
        victims = [a for a in self.active.values() if a.claim.home in gone]
        await self._cancel(victims, release)
        if victims:
            log.info("revoked %d partition(s): %d run(s) cancelled and released", len(gone), len(victims))

    async def _cancel(self, victims: list[Active], release: bool = True) -> None:
        """Cancel these runs, forget them, and (``release``) hand their claims back."""
        for active in victims:
            if active.task is not None:
                active.task.cancel()
        for active in victims:
            if active.task is not None:
                await asyncio.gather(active.task, return_exceptions=True)
            self.active.pop(active.claim.user_id, None)
            if release:
                await self._release(active)

    async def _release(self, active: Active) -> None:
        claim = active.claim
        ids = claim.event_ids + [event.id for event in active.folded]
        try:
            async with self.pool.connection() as conn:
                metrics.RELEASED.inc(await ledger_claims.release_claim(conn, claim, ids))
        except psycopg.Error as exc:
            log.warning("could not release a claim (the next owner recovers it): %s", exc)

    # -- the loops -----------------------------------------------------------------------

    async def claim_loop(self) -> None:
        while not self._stopping:
            now = self.clock.monotonic()
            due = now if self._pass_now else min(self._next_scan, self._timers[0] if self._timers else self._next_scan)
            if due > now:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), due - now)
                except TimeoutError:
                    pass
                continue
            self._pass_now = False
            while self._timers and self._timers[0] <= now:
                heapq.heappop(self._timers)
            self._next_scan = now + self.settings.scan_interval_s
            try:
                with metrics.LEDGER_SECONDS.labels("claim").time():
                    await self._claim_pass()
            except (psycopg.Error, OSError) as exc:
                log.warning("claim pass failed, retrying: %s", exc)
                self._next_scan = self.clock.monotonic() + LEDGER_RETRY_S

    async def _claim_pass(self) -> None:
        free = self.settings.run_concurrency - len(self.active)
        if not self.owned or (free <= 0 and self.clock.monotonic() < self._next_heal):
            return
        async with self._claim_lock:
            owned = dict(self.owned)
            async with self.pool.connection() as conn:
                dead = []
                # Rule 2 and the look for lone last attempts once per scan interval, not on
                # every pass; the claim never takes an exhausted or lone row in between.
                if self.clock.monotonic() >= self._next_dead_check:
                    self._next_dead_check = self.clock.monotonic() + self.settings.scan_interval_s
                    dead = await mark_dead(conn, owned, self.settings.max_attempts)
                    self._alone_at = await alone_due(conn, owned, self.settings.max_attempts)
                    if self._alone_at is None:
                        self._drain_until = None
                if self.clock.monotonic() >= self._next_heal:
                    self._next_heal = self.clock.monotonic() + self.settings.heal_interval_s
                    await self._heal(conn, owned)
                claims, alone = await self._claim(conn, owned, free) if free > 0 else ([], False)
                started = [Active(c, alone=alone) for c in claims]
                if started and getattr(self.agent, "needs_context", True):
                    await self._preload(conn, started)
        if dead:
            metrics.EVENTS_DEAD.inc(len(dead))
            await asyncio.to_thread(self.dead_letters.publish_dead, dead)
        for active in started:
            c = active.claim
            metrics.CLAIM_BATCH.observe(len(c.events))
            for event in c.events:
                metrics.CLAIM_ATTEMPTS.labels(str(min(event.attempts, 3)) if event.attempts < 3 else "3+").inc()
            self.active[c.user_id] = active
            # The task copies the context: every line the run logs names its user, claim and run
            # (and its trace, when traces are on: traces.run puts the run under its span).
            with logs.context(
                user_id=c.user_id, event_id=c.events[0].id, partition=c.home.partition, epoch=c.epoch, run_id=c.run_key
            ):
                active.task = asyncio.create_task(traces.run(self._run(active), c, self.pool), name=f"run-{c.user_id}")
        metrics.RUNS_IN_FLIGHT.set(len(self.active))
        if len(claims) == free:
            self.wake()  # there may be more; a finishing run frees a slot and wakes us

    async def _heal(self, conn, owned: dict[PartitionKey, int]) -> None:
        """Release the claims at our epochs that no run of ours holds.

        Such a row is a finish the ledger lost (its commit vanished with a crashed server or a
        failover) or a run this process forgot: left alone it would mute its user (claim rule
        4) until the next rebalance. It runs inside the claim pass, under the claim lock, so
        every claim this process made is already in ``self.active`` and the only rows it can
        match are orphans. Counted as lost with their worker, as a takeover counts them.
        """
        healed = await ledger_recovery.release_orphaned_claims(
            conn,
            owned,
            list(self.active),
            self.settings.max_attempts,
            self.settings.backoff_base_s,
            self.settings.backoff_cap_s,
        )
        if healed:
            metrics.HEALED.inc(len(healed))
            log.warning(
                "released %d claim(s) at our epoch that no run held (a lost finish?): %d user(s)",
                len(healed),
                len({row.user_id for row in healed}),
            )
            self.wake(self.settings.backoff_base_s + BACKOFF_SLACK_S)

    async def _claim(self, conn, owned: dict[PartitionKey, int], free: int) -> tuple[list[Claim], bool]:
        """Claim rule 3's lone last attempts before anything else, then the round robin.
        Returns the claims and whether they are a lone attempt."""
        if any(a.alone for a in self.active.values()):
            return [], False  # nothing runs beside a lone attempt
        if self._alone_at is not None:
            wait_s = (self._alone_at - utc(self.clock.now())).total_seconds()
            if wait_s > 0:
                self.wake(wait_s + BACKOFF_SLACK_S)  # claim as usual until then
            elif self.active and not await self._drained():
                return [], False  # draining: each finishing run wakes a pass, and so does the deadline
            else:
                lone = await claim_alone(conn, owned, self.settings.max_attempts)
                self._next_dead_check = 0.0  # after it: dead? another one waiting?
                self._drain_until = None
                if lone is not None:
                    metrics.LONE_RUNS.inc()
                    log.warning(
                        "event %d runs alone: its last attempt, and a worker was lost with it before", lone.events[0].id
                    )
                    return [lone], True
                self._alone_at = None
        claims, self._cursor = await claim(
            conn,
            owned,
            list(self.active),
            free,
            self.settings.batch_max,
            self.settings.batch_window_s,
            self.settings.max_attempts,
            self._cursor,
        )
        return claims, False

    async def _drained(self) -> bool:
        """Drain for a lone attempt: wait for the runs in flight, up to ``lone_drain_s``;
        then cancel and release the rest (their attempts are given back, as on a revoke).
        True once nothing runs."""
        now = self.clock.monotonic()
        if self._drain_until is None:
            self._drain_until = now + self.settings.lone_drain_s
            log.info(
                "a lost event's last attempt runs alone: waiting up to %.0f s for %d run(s) in flight",
                self.settings.lone_drain_s,
                len(self.active),
            )
        if now < self._drain_until:
            self.wake(self._drain_until - now + BACKOFF_SLACK_S)
            return False
        # Runs already finished only wait for their commit: let the finisher have them.
        victims = [a for a in self.active.values() if a.task is not None and not a.task.done()]
        await self._cancel(victims)
        if victims:
            log.warning(
                "released %d run(s) still in flight after %.0f s, for a lone attempt",
                len(victims),
                self.settings.lone_drain_s,
            )
        metrics.RUNS_IN_FLIGHT.set(len(self.active))
        return not self.active

    async def _run(self, active: Active) -> None:
        c = active.claim
        started = utc(self.clock.now())
        finished = Finished(c, started, folded=active.folded)
        try:
            ctx = await self._context(active)
            result = await asyncio.wait_for(self.agent.run(ctx), self.settings.run_timeout_s)
            finished.result = result
            finished.folded = active.folded
        except asyncio.CancelledError:
            raise  # revoked or shutting down: the claim is released by whoever cancelled
        except RetryLater as exc:
            exhausted = c.transient_failures + 1 >= self.settings.transient_max_attempts
            finished.error = f"model unavailable: {exc.reason}"
            finished.transient = not exhausted
            finished.backoff_s = backoff_seconds(
                c.transient_failures + 1, self.settings.backoff_base_s, self.settings.backoff_cap_s, exc.retry_after
            )
        except Exception as exc:  # the agent failed: a counted attempt
            log.warning("run failed for a user (attempt %d): %s: %s", c.attempt, type(exc).__name__, exc)
            finished.error = f"{type(exc).__name__}: {exc}"
            finished.backoff_s = backoff_seconds(c.attempt, self.settings.backoff_base_s, self.settings.backoff_cap_s)
        await self.finished.put(finished)

    async def _preload(self, conn, started: list[Active]) -> None:
        """The contexts of a pass's runs, read together: one pipeline on the claim's
        connection instead of a pooled connection and round trips per run. If that fails,
        each run reads its own (and fails as an attempt if it cannot either): the claims are
        committed already, so the pass must still start their runs."""
        ctxs = [self._new_context(active) for active in started]
        try:
            await load_many(conn, ctxs, self._recent_limit)
        except psycopg.Error as exc:
            log.warning("could not read %d runs' context together; each run reads its own: %s", len(ctxs), exc)
            return
        for active, ctx in zip(started, ctxs, strict=True):
            active.ctx = ctx

    async def _context(self, active: Active) -> RunContext:
        if active.ctx is not None:
            return active.ctx
        ctx = self._new_context(active)
        if getattr(self.agent, "needs_context", True):
            async with self.pool.connection() as conn:
                await load_context(conn, ctx, self._recent_limit)
        return ctx

    @property
    def _recent_limit(self) -> int:
        """How many past messages the agent wants (VIGIL_RECENT_MESSAGES for the Claude agent)."""
        return getattr(self.agent, "recent_messages", RECENT_MESSAGES)

    def _new_context(self, active: Active) -> RunContext:
        c = active.claim

        async def fold(sources):
            async with self.pool.connection() as conn:
                more = await claim_more(conn, c, sources)
            active.folded.extend(more)
            return more

        run_key = c.run_key
        return RunContext(
            user_id=c.user_id,
            run_key=run_key,
            events=list(c.events),
            session=None,
            memory={},
            recent_messages=[],
            started_at=utc(self.clock.now()),
            # The host's clock, not ours: the agent checks this against time.monotonic(), and
            # asyncio enforces run_timeout_s on it too.
            deadline=time.monotonic() + self.settings.run_timeout_s,
            fold=fold,
            delegation=Delegation(
                depth=0,
                max_depth=self.settings.max_delegation_depth,
                token_budget=self.settings.task_token_budget,
                timeout_s=self.settings.task_timeout_s,
                max_attempts=self.settings.task_max_attempts,
                owner_chain=(c.user_id, run_key),
            ),
        )

    async def finish_loop(self) -> None:
        while True:
            batch = [await self.finished.get()]
            while len(batch) < self.settings.finish_batch_max and not self.finished.empty():
                batch.append(self.finished.get_nowait())
            began = time.monotonic()  # a measurement, not a decision: the host's clock
            began_ns = time.time_ns()
            while True:
                try:
                    async with self.pool.connection() as conn:
                        committed, stale = await commit_finished(conn, batch, self.settings.instance_id)
                    break
                except (psycopg.Error, OSError) as exc:
                    log.warning("finish commit failed, retrying: %s", exc)
                    # Its outcome is unknown (the commit may have landed, or landed and then
                    # been lost): once the ledger answers again, look for orphaned claims.
                    self._next_heal = 0.0
                    await asyncio.sleep(LEDGER_RETRY_S)
            metrics.LEDGER_SECONDS.labels("finish").observe(time.monotonic() - began)
            traces.finish(batch, began_ns, committed)
            now = utc(self.clock.now())
            landed = {id(run) for run in committed}  # identity: runs are not values to compare
            for run in batch:
                self.active.pop(run.claim.user_id, None)
                if run.error is not None and id(run) in landed:
                    self.wake(run.backoff_s + BACKOFF_SLACK_S)  # its events are claimable again then
                label = "retry_later" if run.transient else run.outcome.value
                metrics.RUNS.labels(label if id(run) in landed else "stale").inc()
                metrics.RUN_SECONDS.observe((now - run.started_at).total_seconds())
            metrics.RUNS_IN_FLIGHT.set(len(self.active))
            self.wake()

    async def gauge_loop(self) -> None:
        while not self._stopping:
            try:
                async with self.pool.connection() as conn:
                    pending = await ledger_events.oldest_pending(conn)
                metrics.OLDEST_PENDING.set(pending.age_s)
                metrics.PENDING.set(pending.pending)
            except psycopg.Error:
                pass
            await asyncio.sleep(GAUGE_INTERVAL_S)

    async def drain(self, grace_s: float) -> None:
        """Shutdown: no new claims; let runs finish for ``grace_s``, then cancel and release."""
        self._stopping = True
        self._wake.set()
        deadline = self.clock.monotonic() + grace_s
        while self.active and self.clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            await self.revoke(list(self.owned), release=True)
