"""The run loop: claims from the ledger, runs the agent, group-commits the finishes.

Runs are driven from the ledger, not from the poll loop: the consumer thread only records
events and wakes this loop; a claim pass here picks whatever the claim rules allow for the
partitions this worker owns, each run executes on its own task, and
``VIGIL_FINISH_CONCURRENCY`` finisher tasks commit finished runs together. A long run
therefore never stalls polling. Passes come when asked
for (a batch window or a backoff ending, a free slot, a takeover) and every scan interval,
which finds what this process was not told about: events recorded by another worker's
consumer for a user whose home partition is ours, an operator's retry.

:class:`Runner` wires the parts (docs/worker.md, "The run loop's parts") and is what
``worker/main.py`` and the consumer call:

- when to claim: :mod:`vigil.worker.wakeups` (the wake-up heap), :mod:`vigil.worker.claim_loop`
  (the claim loop and pass, the partitions held), :mod:`vigil.worker.lone` (the lone attempt:
  its due time, its drain), :mod:`vigil.worker.handover` (a revoke's runs wound down);
- running: :mod:`vigil.worker.runs` (the runs in flight, the agent's execution),
  :mod:`vigil.worker.contexts` (what each run reads first);
- finishing: :mod:`vigil.worker.finish_loop` (the finish queue, the group finish, the backlog gauges).

They talk through narrow callbacks: each run hands its outcome to the finisher's queue
(``finish``), and the finisher asks the claim loop for a pass (``wake``) or a heal
(``on_commit_unknown``), never holding the claimer.
"""

from __future__ import annotations

import asyncio

from vigil.agent.base import Agent
from vigil.clock import Clock, SystemClock
from vigil.ledger.db import AsyncPool
from vigil.worker.claim_loop import Claimer
from vigil.worker.deadletters import DeadLetters
from vigil.worker.finish import Finished
from vigil.worker.finish_loop import Finisher
from vigil.worker.lone import LoneAttempt
from vigil.worker.runs import Runs
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import Shards
from vigil.worker.wakeups import Wakeups

# At shutdown, how long hand-overs whose runs were just released get to clear their deadlines.
HANDOVER_END_S = 2.0


class Runner:
    """The worker's run loop: a claimer, the runs, a finisher, on one clock."""

    def __init__(
        self,
        settings: WorkerSettings,
        agent: Agent,
        pool: AsyncPool | Shards,
        dead_letters: DeadLetters,
        clock: Clock | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.shards = Shards.of(pool)  # where each partition's and run's ledger work goes
        self.wakeups = Wakeups(self.clock, settings.scan_interval_s)
        # Each run hands its outcome to the finish loop's queue (the finisher, made below, owns it).
        self.runs = Runs(settings, agent, self.shards, self.clock, finish=self._finished)
        # Claim rule 3's lone attempt: the claim pass tells it what it finds and starts, and
        # asks it whether to claim; main.py has it drain the background tasks too.
        self.lone = LoneAttempt(settings, self.runs, self.wakeups, self.clock)
        self.claimer = Claimer(settings, self.shards, dead_letters, self.runs, self.wakeups, self.clock, self.lone)
        self.finisher = Finisher(
            settings,
            self.shards,
            self.runs,
            self.clock,
            wake=self.wakeups.wake,
            on_commit_unknown=self.claimer.heal_soon,
        )

    def _finished(self, run: Finished) -> None:
        """A run's outcome, to the finish loop (:meth:`Finisher.put`)."""
        self.finisher.put(run)

    # -- called from the consumer thread (through the event loop) ------------------------

    def wake(self, delay: float = 0.0) -> None:
        """Schedule a claim pass no later than ``delay`` seconds from now (:meth:`Wakeups.wake`)."""
        self.wakeups.wake(delay)

    async def drain(self, grace_s: float) -> None:
        """Shutdown: no new claims; let runs finish for ``grace_s``, then cancel and release."""
        self.claimer.stopping = True
        self.finisher.stopping = True
        self.wakeups.interrupt()
        self.runs.stop_at_boundary(list(self.runs.active.values()))
        deadline = self.clock.monotonic() + grace_s
        while self.runs.active and self.clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.runs.active:
            await self.claimer.revoke(list(self.claimer.owned), release=True)
        # What is left belongs to partitions being handed over (no longer owned): released
        # too, and their hand-overs then end (their deadlines cleared for the next owner).
        leftover = list(self.runs.active.values())
        if leftover:
            await self.runs.cancel(leftover, release=True)
        await self.claimer.handovers_done(max(HANDOVER_END_S, deadline - self.clock.monotonic()))
