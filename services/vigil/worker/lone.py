"""Claim rule 3's lone last attempt and the drain before it (docs/worker.md, "Claiming").

An event lost with its worker before, on its last attempt, runs with nothing else in
flight, so a crash is pinned on an event only when it ran alone. The claim pass finds when
one is due (:func:`vigil.ledger.claims.alone_due`, once per scan interval) and sets
:attr:`LoneAttempt.due_at`; from then on the pass claims nothing new and
:meth:`LoneAttempt.drained` waits up to ``VIGIL_LONE_DRAIN_S`` for the runs in flight, then
cancels and releases the rest. The claim itself is the claim pass's
(:meth:`vigil.worker.claim_loop.Claimer._claim`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Protocol

from vigil.clock import Clock
from vigil.worker import metrics
from vigil.worker.runs import Active, Runs
from vigil.worker.settings import WorkerSettings
from vigil.worker.wakeups import BACKOFF_SLACK_S, Wakeups

log = logging.getLogger(__name__)


class Beside(Protocol):
    """What else runs in the process beside the runs (the background tasks' executor)."""

    def busy(self) -> int: ...

    def hand_back(self) -> int: ...


class LoneAttempt:
    """When a lone last attempt is due, and how long the runs in flight may still take."""

    def __init__(self, settings: WorkerSettings, runs: Runs, wakeups: Wakeups, clock: Clock) -> None:
        self.settings = settings
        self.runs = runs
        self.wakeups = wakeups
        self.clock = clock
        self.due_at: datetime | None = None  # when a last attempt that must run alone is due
        self.drain_until: float | None = None  # draining for it: when to release what still runs
        self.beside: Beside | None = None  # the background tasks in flight here: drained too

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
