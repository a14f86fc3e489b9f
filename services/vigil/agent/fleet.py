"""One fleet toward the model: the worker's side of :mod:`vigil.ledger.fleet`.

Every model call passes a gate (:meth:`FleetGate.call`) that

1. waits out the shared back-off: the latest 429 or 529 any worker was told, read from the
   ledger at most once per ``refresh_s`` (a second) and at once after a wait;
2. takes one of the fleet's slots when ``VIGIL_MODEL_FLEET_CONCURRENCY`` bounds the calls in
   flight across workers, polling while all are held, and gives it back when the call ends.

A wait that would pass the run's deadline is :class:`RetryLater` (the worker releases the
claim without counting an attempt, as for an outage). The ledger unreachable opens the gate:
a run must not fail because the fleet's bookkeeping could not be read (counted in
``vigil_model_fleet_waits_total{reason="ledger_error"}``).

:data:`OPEN` is the gate of a deployment that shares nothing (and of tests that run an
agent without a ledger).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import psycopg

from vigil.agent import metrics
from vigil.agent.base import RetryLater
from vigil.clock import Clock, SystemClock, utc
from vigil.ledger import fleet as ledger_fleet
from vigil.ledger.db import AsyncPool

log = logging.getLogger(__name__)

PROVIDER = "anthropic"
# How often a worker reads the shared back-off when nothing told it to look sooner.
REFRESH_S = 1.0
# How often a call waiting for a fleet slot tries again.
SLOT_POLL_S = 0.1
# A slot's lease beyond the model call's own timeout: a dead worker's slot frees after it.
LEASE_MARGIN_S = 30.0


class Gate:
    """The open gate: every call passes at once, nothing is shared."""

    @asynccontextmanager
    async def call(self, deadline: float) -> AsyncIterator[None]:
        yield

    async def told(self, reason: str, pause_s: float) -> None:
        return None


OPEN = Gate()


class FleetGate(Gate):
    """The gate shared through the ledger (see the module doc)."""

    def __init__(
        self,
        pool: AsyncPool,
        *,
        concurrency: int,
        shared_backoff: bool,
        instance: str,
        call_timeout_s: float,
        clock: Clock | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.pool = pool
        self.concurrency = concurrency
        self.shared_backoff = shared_backoff
        self.instance = instance
        self.lease_s = call_timeout_s + LEASE_MARGIN_S
        self.clock = clock or SystemClock()
        self.refresh_s = refresh_s
        self._calls = itertools.count(1)
        self._pause_until = 0.0  # wall-clock seconds: the shared back-off last read or told
        self._read_at = float("-inf")  # monotonic: when it was last read
        self._reading = asyncio.Lock()

    async def start(self) -> None:
        """The fleet's slots exist (a worker's start; the lowest bound any worker has set wins
        as slots free up, see ``fleet_slots_trim``)."""
        if self.concurrency:
            async with self.pool.connection() as conn:
                await ledger_fleet.make_slots(conn, size=self.concurrency, now=utc(self.clock.now()))

    @asynccontextmanager
    async def call(self, deadline: float) -> AsyncIterator[None]:
        await self._wait_for_backoff(deadline)
        slot, holder = await self._take_slot(deadline)
        try:
            yield
        finally:
            if slot is not None:
                await asyncio.shield(self._give_back(slot, holder))

    async def told(self, reason: str, pause_s: float) -> None:
        """The provider answered 429 or 529 with this pause: every worker waits it out."""
        if not self.shared_backoff or pause_s <= 0:
            return
        now = utc(self.clock.now())
        self._pause_until = max(self._pause_until, now.timestamp() + pause_s)
        try:
            async with self.pool.connection() as conn:
                await ledger_fleet.slow_down(
                    conn,
                    provider=PROVIDER,
                    until=now + timedelta(seconds=pause_s),
                    reason=reason,
                    set_by=self.instance,
                    now=now,
                )
        except psycopg.Error as exc:
            metrics.FLEET_WAITS["ledger_error"].inc()
            log.warning("the shared model back-off could not be written: %s", exc, extra={"event": "fleet_error"})

    async def _wait_for_backoff(self, deadline: float) -> None:
        if not self.shared_backoff:
            return
        waited = False
        while True:
            await self._refresh(force=waited)
            pause = self._pause_until - self.clock.now()
            if pause <= 0:
                return
            if time.monotonic() + pause > deadline:
                raise RetryLater("the fleet's shared model back-off outlasts the run", pause)
            if not waited:
                metrics.FLEET_WAITS["backoff"].inc()
            metrics.FLEET_WAIT_SECONDS.observe(pause)
            waited = True
            await asyncio.sleep(pause)

    async def _refresh(self, force: bool) -> None:
        if not force and time.monotonic() - self._read_at < self.refresh_s:
            return
        async with self._reading:
            if not force and time.monotonic() - self._read_at < self.refresh_s:
                return  # another call read it while this one waited for the lock
            try:
                async with self.pool.connection() as conn:
                    pause = await ledger_fleet.paused_until(conn, provider=PROVIDER, now=utc(self.clock.now()))
            except psycopg.Error as exc:
                metrics.FLEET_WAITS["ledger_error"].inc()
                log.warning("the shared model back-off could not be read: %s", exc, extra={"event": "fleet_error"})
                pause = None
            self._read_at = time.monotonic()
            if pause is not None:
                self._pause_until = max(self._pause_until, pause.until.timestamp())

    async def _take_slot(self, deadline: float) -> tuple[int | None, str]:
        holder = f"{self.instance}:{next(self._calls)}"
        if not self.concurrency:
            return None, holder
        started = time.monotonic()
        waited = False
        while True:
            try:
                async with self.pool.connection() as conn:
                    slot = await ledger_fleet.take_slot(
                        conn, size=self.concurrency, holder=holder, lease_s=self.lease_s, now=utc(self.clock.now())
                    )
            except psycopg.Error as exc:
                metrics.FLEET_WAITS["ledger_error"].inc()
                log.warning("no fleet slot could be taken: %s", exc, extra={"event": "fleet_error"})
                return None, holder
            if slot is not None:
                if waited:
                    metrics.FLEET_WAIT_SECONDS.observe(time.monotonic() - started)
                return slot, holder
            if not waited:
                metrics.FLEET_WAITS["slot"].inc()
                waited = True
            if time.monotonic() + SLOT_POLL_S > deadline:
                raise RetryLater("every fleet model slot stayed held", None)
            await asyncio.sleep(SLOT_POLL_S)

    async def _give_back(self, slot: int, holder: str) -> None:
        try:
            async with self.pool.connection() as conn:
                await ledger_fleet.give_back(conn, slot=slot, holder=holder)
        except psycopg.Error as exc:  # its lease frees it
            log.warning("fleet slot %d not given back: %s", slot, exc, extra={"event": "fleet_error"})
