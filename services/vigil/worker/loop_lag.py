"""The event loop's lag: how late a timer fires (``vigil_worker_event_loop_lag_seconds``).

A worker is one event loop. Every run in flight (thousands, while they wait on the model),
every claim pass and every finish shares it; when the callbacks that are ready at once take
longer than the loop can give them, everything waits its turn, and none of the ledger or
model timings show why. The model-bound benchmark found exactly this: answers arriving in
waves stalled the loop for 200-560 ms at a time, and runs took a second longer than their
answers (docs/performance.md, "Answers in waves"). A timer every
``LAG_INTERVAL_S`` and how late it woke is the direct measure; a p90 lag near the run
durations one sees means the worker needs more processes, not more slots.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

LAG_INTERVAL_S = 0.25  # four wake-ups a second: cheap, and finer than any stall worth knowing


async def watch(
    observe: Callable[[float], None],
    interval_s: float = LAG_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Sleep ``interval_s`` again and again, observing how late each wake-up was, until cancelled."""
    while True:
        due = clock() + interval_s
        await asyncio.sleep(interval_s)
        observe(max(0.0, clock() - due))
