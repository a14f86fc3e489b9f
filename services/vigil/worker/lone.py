"""Claim rule 3's lone last attempt and the drain before it (docs/worker.md, "Claiming").

An event lost with its worker before, on its last attempt, runs with nothing else in
flight, so a crash is pinned on an event only when it ran alone. The claim pass looks for
one on each shard (:func:`vigil.ledger.claims.alone_due`, once per scan interval) and tells
:meth:`LoneAttempt.found`, which keeps the earliest as :attr:`LoneAttempt.due_at`; from then
on :meth:`LoneAttempt.gate` holds the pass's claims back and :meth:`LoneAttempt.drained`
waits up to ``VIGIL_LONE_DRAIN_S`` for the runs in flight, then cancels and releases the
rest. The claim itself is the claim pass's (:meth:`vigil.worker.claim_loop.Claimer._claim`),
which reports it with :meth:`LoneAttempt.end_drain` and :meth:`LoneAttempt.started`.
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


class Gate(Enum):
    """What a shard's claim may do now, for the lone attempt (:meth:`LoneAttempt.gate`)."""

    CLAIM = "claim"  # as usual: none is due, or not yet
    HOLD = "hold"  # nothing: one is in flight, or the drain before it goes on, or it is another shard's
    ALONE = "alone"  # this shard's lone attempt, now: nothing else runs


class LoneAttempt:
    """When a lone last attempt is due, how long the runs in flight may still take, and the lone run."""

    def __init__(
        self, settings: WorkerSettings, runs: Runs, wakeups: Wakeups, clock: Clock, beside: Beside | None = None
    ) -> None:
        self.settings = settings
        self.runs = runs
        self.wakeups = wakeups
        self.clock = clock
        self.due_at: datetime | None = None  # when a last attempt that must run alone is due
        self.drain_until: float | None = None  # draining for it: when to release what still runs
        self.beside = beside  # the background tasks in flight here: drained too
        self._due: dict[int, datetime] = {}  # per shard, when a lone last attempt is due there
        self._lone: Active | None = None  # the last lone last attempt this process started (claim rule 3)

    def drain_beside(self, beside: Beside) -> None:
        """Drain ``beside`` too (the background tasks' executor, made after the run loop)."""
        self.beside = beside

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

    def started(self, active: Active) -> None:
        """The claim pass started ``active``, a lone attempt: nothing is claimed while it runs."""
        self._lone = active

    def end_drain(self) -> None:
        """The lone attempt was claimed (or was gone when the pass came to claim it): the drain
        for it is over."""
        self.drain_until = None

    def in_flight(self) -> bool:
        """Is the lone last attempt still in flight? (A look at one run, not at every run in
        flight: with thousands of them, that walk was 0.5% of a model-bound worker's CPU.)"""
        lone = self._lone
        return lone is not None and self.active.get(lone.claim.user_id) is lone

    def tasks_hold_off(self) -> bool:
        """Whether background tasks must not be claimed now: a lone last attempt is due (the
        drain before it) or in flight (claim rule 3: nothing else runs in this process)."""
        due = self.due_at
        return self.in_flight() or (due is not None and due <= utc(self.clock.now()))

    async def gate(self, shard: int) -> Gate:
        """What ``shard``'s claim may do now: as usual until a lone attempt is due (a pass
        asked for when it is), then nothing until the drain before it is over, then the lone
        attempt, on its own shard; nothing while it is in flight."""
        if self.in_flight():
            return Gate.HOLD  # nothing runs beside a lone attempt
        if self.due_at is None:
            return Gate.CLAIM
        wait_s = (self.due_at - utc(self.clock.now())).total_seconds()
        if wait_s > 0:
            self.wakeups.wake(wait_s + BACKOFF_SLACK_S)  # claim as usual until then
            return Gate.CLAIM
        if self.busy() and not await self.drained():
            return Gate.HOLD  # draining: each finishing run wakes a pass, and so does the deadline
        if self._due.get(shard) != self.due_at:
            return Gate.HOLD  # drained for another shard's lone attempt: that shard claims it
        return Gate.ALONE

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
