"""When the next claim pass is due (docs/worker.md, "Claiming").

Passes come when asked for (:meth:`Wakeups.wake`: a batch window ending, a backoff ending, a
run finishing, a takeover) and every ``VIGIL_SCAN_INTERVAL_S``, which finds work this process
was not told about. Requested times are kept in a heap on the clock's ``monotonic()``, so a
pass in between does not cancel a later request. No ledger, no Kafka: the claim loop
(:mod:`vigil.worker.claim_loop`) asks :meth:`Wakeups.due_in` and waits on :meth:`Wakeups.wait`.
"""

from __future__ import annotations

import asyncio
import heapq

from vigil.clock import Clock

# A ledger error in the loop is retried after this long: long enough not to hammer a
# database that is failing over, short enough that users barely notice.
LEDGER_RETRY_S = 1.0
# Requested passes closer together than this are one pass (the consumer asks after every batch).
TIMER_MERGE_S = 0.005
# A pass for a backoff's end comes this much after it: the wake-up runs on the monotonic clock,
# the claim decides on the wall clock the pass reads a moment later, and a tie must not miss it.
BACKOFF_SLACK_S = 0.005


class Wakeups:
    """The claim loop's schedule: requested passes (a heap), an immediate one, the periodic scan."""

    def __init__(self, clock: Clock, scan_interval_s: float) -> None:
        self.clock = clock
        self.scan_interval_s = scan_interval_s
        self._wake = asyncio.Event()
        self._timers: list[float] = []  # monotonic times of requested passes (a heap)
        self._last_timer = 0.0
        self._pass_now = False
        self._next_scan = 0.0  # the first pass comes at once

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

    def due_in(self) -> float:
        """Seconds until the next pass is due; zero or less: due now."""
        now = self.clock.monotonic()
        due = now if self._pass_now else min(self._next_scan, self._timers[0] if self._timers else self._next_scan)
        return due - now

    def begin_pass(self) -> None:
        """A pass starts: it serves every request due by now, and the next scan is an interval away."""
        now = self.clock.monotonic()
        self._pass_now = False
        while self._timers and self._timers[0] <= now:
            heapq.heappop(self._timers)
        self._next_scan = now + self.scan_interval_s

    def retry_in(self, seconds: float) -> None:
        """The pass failed: the next one comes ``seconds`` from now (requests due sooner still come first)."""
        self._next_scan = self.clock.monotonic() + seconds

    async def wait(self, seconds: float) -> None:
        """Until a wake-up is requested or ``seconds`` pass, whichever is first (then ask :meth:`due_in` again)."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass

    def interrupt(self) -> None:
        """End a :meth:`wait` now (shutdown: the loop sees it is stopping)."""
        self._wake.set()
