"""The event loop's lag (vigil.worker.loop_lag): a callback that holds the loop shows as a
late wake-up of the watcher's timer; an idle loop's wake-ups are on time."""

from __future__ import annotations

import asyncio
import time

from vigil.worker import loop_lag


def test_a_callback_holding_the_loop_shows_as_lag():
    seen: list[float] = []

    async def go():
        watcher = asyncio.create_task(loop_lag.watch(seen.append, interval_s=0.05))
        await asyncio.sleep(0.3)  # wake-ups on time
        on_time = len(seen)
        time.sleep(0.4)  # what a burst of ready callbacks does to every timer in the loop
        await asyncio.sleep(0.2)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return on_time

    on_time = asyncio.run(go())
    assert on_time >= 3, seen
    assert min(seen[:on_time]) < 0.05, seen
    assert max(seen) >= 0.3, seen  # the held 0.4 s, less the part of the interval it fell in
