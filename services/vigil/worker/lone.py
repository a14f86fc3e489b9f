"""Claim rule 3's lone last attempt and the drain before it (docs/worker.md, "Claiming").

An event lost with its worker before, on its last attempt, runs with nothing else in
flight, so a crash is pinned on an event only when it ran alone. The claim pass looks for
one on each shard (:func:`vigil.ledger.claims.alone_due`, once per scan interval) and tells
:meth:`LoneAttempt.found`, which keeps the earliest as :attr:`LoneAttempt.due_at`; from then
on :meth:`LoneAttempt.turn` lets the pass claim nothing new while :meth:`LoneAttempt.drained`
waits up to ``VIGIL_LONE_DRAIN_S`` for the runs in flight, then cancels and releases the
rest. The claim itself is the claim pass's (:meth:`vigil.worker.claim_loop.Claimer._claim`),
which reports it back (:meth:`LoneAttempt.claimed`, :meth:`LoneAttempt.started`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from enum import Enum
from typing import Protocol

from vigil.clock import Clock, utc
from vigil.worker import metrics
from vigil.worker.runs import Active, Runs
from vigil.worker.settings import WorkerSettings
from vigil.worker.wakeups import BACKOFF_SLACK_S, Wakeups

log = logging.getLogger(__name__)


class Beside(Protocol):
    """What else runs in the process beside the runs (the background tasks' executor)."""

    def busy(self) -> int: ...

    def hand_back(self) -> int: ...


class Turn(Enum):
    """What a claim on one shard may take now (:meth:`LoneAttempt.turn`)."""

    USUAL = "usual"  # no lone attempt is due: the round robin
    NOTHING = "nothing"  # draining for a lone attempt, or one is in flight
    ALONE = "alone"  # drained: claim this shard's lone attempt


class LoneAttempt:
    """When a lone last attempt is due, how long the runs in flight may still take, and the
    one in flight."""

    def __init__(self, settings: WorkerSettings, runs: Runs, wakeups: Wakeups, clock: Clock) -> None:
        self.settings = settings
        self.runs = runs
        self.wakeups = wakeups
        self.clock = clock
        self.due_at: datetime | None = None  # when a last attempt that must run alone is due
        self.drain_until: float | None = None  # draining for it: when to release what still runs
        self.beside: Beside | None = None  # the background tasks in flight here: drained too
        self._due: dict[int, datetime] = {}  # per shard, when a lone last attempt is due there
        self._running: Active | None = None  # the last lone attempt this process started (claim rule 3)

    def found(self, shard: int, due: datetime | None) -> None:
        """What rule 2's look found on ``shard``: the earliest lone attempt of every shard is
        the one the worker drains for (nothing runs beside it, whatever its shard)."""
        if due is None:
            self._due.pop(shard, None)
        else:
            self._due[shard] = due
        self.due_at = min(self._due.values()) if self._due else None
        if self.due_at is None:
            self.drain_until = None

    def in_flight(self) -> bool:
        """Is the lone last attempt still in flight? (A look at one run, not at every run in
        flight: with thousands of them, that walk was 0.5% of a model-bound worker's CPU.)"""
        lone = self._running
        return lone is not None and self.active.get(lone.claim.user_id) is lone

    def holds_off(self) -> bool:
        """A lone last attempt is due (the drain before it) or in flight: nothing else starts."""
        due = self.due_at
        return self.in_flight() or (due is not None and due <= utc(self.clock.now()))

    async def turn(self, shard: int) -> Turn:
        """What a claim on ``shard`` may take now: as usual until a lone attempt is due (a pass
        is asked for then), nothing while the runs in flight drain or another shard's lone
        attempt is due, and this shard's lone attempt once drained."""
        if self.in_flight():
            return Turn.NOTHING  # nothing runs beside a lone attempt
        if self.due_at is None:
            return Turn.USUAL
        wait_s = (self.due_at - utc(self.clock.now())).total_seconds()
        if wait_s > 0:
            self.wakeups.wake(wait_s + BACKOFF_SLACK_S)  # claim as usual until then
            return Turn.USUAL
        if self.busy() and not await self.drained():
            return Turn.NOTHING  # draining: each finishing run wakes a pass, and so does the deadline
        if self._due.get(shard) != self.due_at:
            return Turn.NOTHING  # drained for another shard's lone attempt: that shard claims it
        return Turn.ALONE

    def claimed(self) -> None:
        """The claim of a lone attempt was made (or found none): the drain is over."""
        self.drain_until = None

    def started(self, active: Active) -> None:
        """``active`` is the lone attempt, running: nothing is claimed beside it until it leaves."""
        self._running = active

    def busy(self) -> bool:
        """Does anything run in this process: a run, or a background task?"""
        return bool(self.active) or (self.beside is not None and self.beside.busy() > 0)

    @property
    def active(self) -> dict[str, Active]:
        return self.runs.active

    async def drained(self) -> bool:
        """Drain for a lone attempt: wait for the runs and background tasks in flight, up to
        ``lone_drain_s``; then cancel and release the rest (their attempts are given back, as
        on a revoke or a shutdown). True once nothing runs. A task crashing the worker beside
        the lone attempt would pin the crash on the event: its last attempt, its death."""
        now = self.clock.monotonic()
        if self.drain_until is None:
            self.drain_until = now + self.settings.lone_drain_s
            log.info(
                "a lost event's last attempt runs alone: waiting up to %.0f s for %d run(s) and %d task(s) in flight",
                self.settings.lone_drain_s,
                len(self.active),
                self.beside.busy() if self.beside is not None else 0,
            )
        if now < self.drain_until:
            self.wakeups.wake(self.drain_until - now + BACKOFF_SLACK_S)
            return False
        # Runs already finished only wait for their commit: let the finisher have them.
        victims = [a for a in self.active.values() if a.task is not None and not a.task.done()]
        await self.runs.cancel(victims)
        if self.beside is not None and self.beside.hand_back():
            log.warning("handed back the background tasks still in flight, for a lone attempt")
        if self.busy():
            self.wakeups.wake(BACKOFF_SLACK_S)  # the handed-back tasks leave in a moment
        if victims:
            log.warning(
                "released %d run(s) still in flight after %.0f s, for a lone attempt",
                len(victims),
                self.settings.lone_drain_s,
            )
        metrics.RUNS_IN_FLIGHT.set(len(self.active))
        return not self.busy()
