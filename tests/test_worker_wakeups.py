"""When the worker claims, on a clock the test moves (vigil.clock.ManualClock): the wake-up
schedule (worker/wakeups.py) and the lone-attempt drain (worker/lone.py). docs/worker.md,
"Claiming"."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from psycopg_pool import AsyncConnectionPool

from vigil.agent.base import EventRow
from vigil.clock import ManualClock
from vigil.ledger.claims import Claim
from vigil.ledger.db import connection_kwargs
from vigil.ledger.partitions import PartitionKey
from vigil.settings import load
from vigil.worker.lone import LoneAttempt
from vigil.worker.runs import Active, Runs
from vigil.worker.settings import WorkerSettings
from vigil.worker.wakeups import BACKOFF_SLACK_S, TIMER_MERGE_S, Wakeups

T0 = 1_000.0


def test_a_requested_pass_outlives_the_passes_before_it():
    clock = ManualClock(T0)
    wakeups = Wakeups(clock, scan_interval_s=60.0)
    assert wakeups.due_in() <= 0  # the first pass comes at once
    wakeups.begin_pass()
    assert wakeups.due_in() == 60.0  # then the periodic scan

    wakeups.wake(0.3)  # the batch window of what was just recorded ends then
    assert wakeups.due_in() == pytest.approx(0.3)
    clock.advance(0.1)
    wakeups.wake()  # a finish frees a slot: a pass now
    assert wakeups.due_in() <= 0
    wakeups.begin_pass()
    assert wakeups.due_in() == pytest.approx(0.2), "the pass in between kept the requested one"
    clock.advance(0.2)
    assert wakeups.due_in() <= 0
    wakeups.begin_pass()
    assert wakeups.due_in() == pytest.approx(60.0), "the scan comes an interval after the last pass"


def test_requests_milliseconds_apart_are_one_pass_and_a_failed_pass_retries_sooner():
    clock = ManualClock(T0)
    wakeups = Wakeups(clock, scan_interval_s=60.0)
    wakeups.begin_pass()
    wakeups.wake(5.0)
    wakeups.wake(5.0 + TIMER_MERGE_S / 2)  # the consumer asks after every batch
    wakeups.wake(7.0)
    clock.advance(5.0 + TIMER_MERGE_S)
    wakeups.begin_pass()
    assert wakeups.due_in() == pytest.approx(2.0 - TIMER_MERGE_S), "the two early requests were served by one pass"
    wakeups.retry_in(1.0)  # the ledger refused the pass
    assert wakeups.due_in() == pytest.approx(1.0)


def _claim(user_id: str) -> Claim:
    event = EventRow(
        id=1,
        user_id=user_id,
        source="test",
        source_id=user_id,
        kind="message",
        payload="{}",
        session_id=None,
        received_at=datetime(2026, 1, 1, tzinfo=UTC),
        attempts=1,
    )
    return Claim(user_id, PartitionKey("events", 0), 1, [event], 0, event.received_at)


def test_the_lone_attempt_drain_waits_on_the_clock_then_cancels_what_still_runs(ledger, monkeypatch):
    """Thirty seconds of drain in no time: nothing is cancelled while the clock stays short of
    VIGIL_LONE_DRAIN_S, and a pass is asked for at its end; past it the run is cancelled."""
    monkeypatch.setenv("VIGIL_DATABASE_URL", ledger)
    settings = load(WorkerSettings, lone_drain_s=30.0, scan_interval_s=60.0)
    clock = ManualClock(T0)

    async def go():
        async with AsyncConnectionPool(ledger, min_size=1, kwargs=connection_kwargs(autocommit=True)) as pool:
            runs = Runs(settings, agent=None, pool=pool, clock=clock)
            wakeups = Wakeups(clock, settings.scan_interval_s)
            wakeups.begin_pass()
            lone = LoneAttempt(settings, runs, wakeups, clock)
            slow = Active(_claim("slow"), task=asyncio.create_task(asyncio.sleep(3600)))
            runs.active["slow"] = slow

            assert not await lone.drained()
            assert wakeups.due_in() == pytest.approx(30.0 + BACKOFF_SLACK_S), "a pass when the drain ends"
            clock.advance(29.9)
            assert not await lone.drained()
            assert not slow.task.done() and "slow" in runs.active
            clock.advance(0.2)
            assert await lone.drained()
            assert slow.task.cancelled() and not runs.active

    asyncio.run(go())
