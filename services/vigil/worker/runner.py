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
  (the claim loop and pass, the partitions held), :mod:`vigil.worker.lone` (the lone-attempt drain);
- running: :mod:`vigil.worker.runs` (the runs in flight, their context, the agent's execution);
- finishing: :mod:`vigil.worker.finish_loop` (the group finish, the backlog gauges).
"""

from __future__ import annotations

import asyncio

from vigil.agent.base import Agent
from vigil.clock import Clock, SystemClock
from vigil.ledger.db import AsyncPool
from vigil.worker.claim_loop import Claimer
from vigil.worker.fencing import PartitionKey
from vigil.worker.finish import Finished
from vigil.worker.finish_loop import Finisher
from vigil.worker.runs import Active, Runs
from vigil.worker.settings import WorkerSettings
from vigil.worker.wakeups import Wakeups

# At shutdown, how long hand-overs whose runs were just released get to clear their deadlines.
HANDOVER_END_S = 2.0


class Runner:
    """The worker's run loop: a claimer, the runs, a finisher, on one clock."""

    def __init__(
        self,
        settings: WorkerSettings,
        agent: Agent,
        pool: AsyncPool,
        dead_letters,
        clock: Clock | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.wakeups = Wakeups(self.clock, settings.scan_interval_s)
        self.runs = Runs(settings, agent, pool, self.clock)
        self.claimer = Claimer(settings, pool, dead_letters, self.runs, self.wakeups, self.clock)
        self.finisher = Finisher(settings, pool, self.runs, self.claimer, self.clock)

    @property
    def owned(self) -> dict[PartitionKey, int]:
        return self.claimer.owned

    @property
    def active(self) -> dict[str, Active]:
        return self.runs.active

    @property
    def finished(self) -> asyncio.Queue[Finished]:
        return self.runs.finished

    # -- called from the consumer thread (through the event loop) ------------------------

    def wake(self, delay: float = 0.0) -> None:
        """Schedule a claim pass no later than ``delay`` seconds from now (:meth:`Wakeups.wake`)."""
        self.wakeups.wake(delay)

    async def assign(self, epochs: dict[PartitionKey, int]) -> None:
        await self.claimer.assign(epochs)

    async def revoke(self, keys: list[PartitionKey], release: bool = True, grace_s: float = 0.0) -> None:
        await self.claimer.revoke(keys, release, grace_s)

    async def hand_over(self, keys: list[PartitionKey], grace_s: float) -> None:
        await self.claimer.hand_over(keys, grace_s)

    # -- the loops (tasks started by worker/main.py) -------------------------------------

    async def claim_loop(self) -> None:
        await self.claimer.claim_loop()

    async def finish_loop(self) -> None:
        await self.finisher.finish_loop()

    async def gauge_loop(self) -> None:
        await self.finisher.gauge_loop()

    async def drain(self, grace_s: float) -> None:
        """Shutdown: no new claims; let runs finish for ``grace_s``, then cancel and release."""
        self.claimer.stopping = True
        self.finisher.stopping = True
        self.wakeups.interrupt()
        self.runs.stop_at_boundary(list(self.runs.active.values()))
        deadline = self.clock.monotonic() + grace_s
        while self.active and self.clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            await self.revoke(list(self.owned), release=True)
        # What is left belongs to partitions being handed over (no longer owned): released
        # too, and their hand-overs then end (their deadlines cleared for the next owner).
        leftover = list(self.active.values())
        if leftover:
            await self.runs.cancel(leftover, release=True)
        await self.claimer.handovers_done(max(HANDOVER_END_S, deadline - self.clock.monotonic()))
