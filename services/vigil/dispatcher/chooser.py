"""Choosing what to send: which users the next claim looks at.

:func:`vigil.dispatcher.claims.claim` fixes and commits what is due among the users it is
given; this part decides which users those are. A sweep (claims from the first user to the
last, a round robin) reads every user holding messages; the next one starts after a pause
that the last one's cost sets (:data:`SWEEP_IDLE_FACTOR`), and the claims in between look
only at users with messages written since the loop last looked, users whose delivery just
ended (:meth:`Chooser.ended`), and users whose gap, backoff or lease the loop saw end
(:class:`Wakeups`: every user a claim looked at and held). Only a user the loop has not seen
since it started (a restart, another replica's) waits for a sweep. Ids below the highest seen
that had no row yet (a transaction that committed after a later one) are looked at again
until they do, for :data:`GAP_WAIT_S`.

It owns the claims' cursor, the outbox mark, the sweep's schedule, the users to look at again
and the missing ids; nothing else reads or writes them.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.clock import Clock, utc
from vigil.dispatcher import metrics
from vigil.dispatcher.channels import Result
from vigil.dispatcher.claims import ClaimConflict, Claimed, Limits, claim
from vigil.ledger.channels import ChannelRow

log = logging.getLogger("vigil.dispatcher")

# Claims in a row that may lock nothing before a pass gives up (other replicas hold the due
# users, or the sweep wrapped): each one moves the cursor on.
MAX_EMPTY_CLAIMS = 4
# A sweep reads every user that holds messages, most of them waiting out their gap (100,000
# such users: 0.85 s of PostgreSQL). Between sweeps the loop claims only among users with
# new messages; the next sweep starts this many times the last sweep's closing claim later
# (at least a poll interval): at most about a tenth of the time goes to sweeping.
SWEEP_IDLE_FACTOR = 9.0
# ... and at most this long after it: a held message waits at most about this long past its
# gap however many users hold messages.
SWEEP_PAUSE_MAX_S = 60.0
# Users the loop will look at again between sweeps when their gap, backoff or lease ends (a
# user it has seen since it started: a new message, a delivery that ended, a held claim).
# Beyond this many, the sweeps find the rest.
MAX_WAKEUPS = 100_000
# Outbox ids a claim between sweeps found missing below the highest one (a transaction that
# took its ids before a later one committed, still open then) are looked at again by the
# next claims for this long, a statement's timeout; an id whose transaction rolled back is
# never filled. At most this many at once; the sweeps find the rest.
GAP_WAIT_S = 30.0
MAX_GAPS = 10_000


class Wakeups:
    """Users to look at again at a given moment (the dispatcher's clock), earliest first. One
    moment per user, the latest one reported; at most ``limit`` users."""

    def __init__(self, limit: int = MAX_WAKEUPS):
        self.limit = limit
        self._at: dict[str, datetime] = {}
        self._heap: list[tuple[datetime, str]] = []

    def __len__(self) -> int:
        return len(self._at)

    def add(self, user: str, at: datetime) -> None:
        if self._at.get(user) == at or (user not in self._at and len(self._at) >= self.limit):
            return
        self._at[user] = at
        heapq.heappush(self._heap, (at, user))
        if len(self._heap) > 2 * self.limit:  # superseded entries: rebuild from the live ones
            self._heap = [(when, who) for who, when in self._at.items()]
            heapq.heapify(self._heap)

    def due(self, now: datetime, most: int) -> list[str]:
        """Take up to ``most`` users whose moment has come."""
        users: list[str] = []
        while self._heap and self._heap[0][0] <= now and len(users) < most:
            at, user = heapq.heappop(self._heap)
            if self._at.get(user) == at:  # else superseded by a later report
                del self._at[user]
                users.append(user)
        return users


class Chooser:
    """Claims the next users due: a sweep's next ones, or between sweeps those the loop has
    reason to look at. ``conn`` returns the loop's ledger connection."""

    def __init__(
        self,
        limits: Limits,
        clock: Clock,
        poll_interval_s: float,
        conn: Callable[[], psycopg.Connection[DictRow]],
        catalog: Callable[[list[str]], Mapping[str, ChannelRow]] | None = None,
    ):
        self.limits = limits
        self._catalog = catalog  # the locked users' channels, on a shard other than the catalog
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self._conn = conn
        self._after = ""  # the claims' round-robin cursor: the last user of the last full pass
        self._mark: int | None = None  # outbox ids up to this were there for the last sweep or claim
        self._sweep_at = 0.0  # monotonic time the next sweep may start
        self._sweep_started = 0.0  # Unix time the sweep in progress started
        # Users whose delivery ended since the last claim between sweeps: messages written
        # while it was in flight were not due then, and may be now.
        self._recheck: set[str] = set()
        # Users seen holding messages not due yet: looked at again when they may be.
        self._wakeups = Wakeups()
        # Outbox ids below the mark that had no row when looked at: id -> when (monotonic).
        self._gaps: dict[int, float] = {}

    def ended(self, user: str) -> None:
        """A delivery to ``user`` ended (delivered, retried later or dead): the next claim
        between sweeps looks at the user again."""
        self._recheck.add(user)

    def claim_due(self, users: int, sweep: bool = False) -> tuple[Claimed, float | None]:
        """A claim of up to ``users`` due users, counted in the metrics; nothing when it
        conflicted (rolled back). Part of a sweep (the round robin from its cursor) when one is
        in progress, ``sweep`` asks for one or the next one is due; otherwise among the users
        with messages written since the last claim looked (the outbox ids after the mark).
        Also the start (Unix time) of the sweep this claim closed, if it closed one."""
        limits = self.limits if users == self.limits.batch_users else replace(self.limits, batch_users=users)
        now = utc(self.clock.now())
        sweeping = sweep or self._after != "" or self._mark is None or time.monotonic() >= self._sweep_at
        if sweeping and self._after == "":
            self._sweep_started = time.time()
            self._recheck.clear()  # the sweep looks at every user
        if not sweeping:
            self._recheck.update(self._wakeups.due(now, limits.fresh_max))
        started = time.monotonic()
        recheck = sorted(self._recheck)
        try:
            if sweeping:
                claimed = self._claim(now, limits, wrap=sweep)
            else:
                gaps = sorted(self._gaps)
                claimed = claim(
                    self._conn(),
                    now,
                    limits,
                    fresh_after=self._mark,
                    recheck=recheck,
                    gaps=gaps,
                    catalog=self._catalog,
                )
                self._track_gaps(gaps, claimed.missing)
        except ClaimConflict as exc:
            metrics.CLAIM_CONFLICTS.inc()
            log.error("claim rolled back: %s", exc)
            self._after = ""
            self._sweep_at = 0.0  # a new sweep from the first user next
            return Claimed(), None
        for user, at in claimed.waits:
            self._wakeups.add(user, at)
        metrics.WAKEUPS.set(len(self._wakeups))
        closed_sweep: float | None = None
        if sweeping:
            if self._mark is None or (self._after == "" and claimed.high > self._mark + limits.fresh_max):
                # What this sweep is sure to see; later rows are fresh. Otherwise the claims
                # after the sweep look at the rows since the last claim between sweeps again:
                # one the sweep's snapshot missed (committed after it, with a lower id than one
                # it saw) would wait for the next sweep.
                self._mark = claimed.high
            self._after = claimed.cursor
            if not claimed.cursor:  # the sweep is done: the next one after a pause it pays for
                closed_sweep = self._sweep_started
                cost = time.monotonic() - started
                pause = min(SWEEP_PAUSE_MAX_S, max(self.poll_interval_s, SWEEP_IDLE_FACTOR * cost))
                self._sweep_at = time.monotonic() + pause
                metrics.SWEEPS.inc()
                metrics.SWEEP_PAUSE.set(pause)
        elif claimed.users_locked >= users or claimed.high > (self._mark or 0) + limits.fresh_max:
            self._sweep_at = 0.0  # more new messages than one claim takes: a sweep takes them in turn
        else:
            self._mark = max(self._mark or 0, claimed.high)  # every new message looked at
            self._recheck.difference_update(recheck)
        for delivery in claimed.lost:
            metrics.RETRIES.labels(delivery.channel.type.value, "lost").inc()
            log.warning(
                "delivery %s to %s: lease ran out with no outcome, sending again",
                delivery.delivery_id,
                delivery.user_id,
            )
        for delivery in claimed.buried:
            metrics.DEAD.labels(delivery.channel.type.value, "lost").inc()
            metrics.DELIVERIES.labels(delivery.channel.type.value, Result.DEAD.value).inc()
        metrics.URGENT_BYPASSES.inc(claimed.bypasses)
        for delivery in claimed.deliveries:
            if delivery.attempt == 1:
                metrics.JOINED.observe(len(delivery.rows))
        return claimed, closed_sweep

    def _track_gaps(self, looked_at: list[int], missing: list[int]) -> None:
        """Keep the ids a claim found missing for the next claims, until they are filled or
        :data:`GAP_WAIT_S` has passed since they were first missed."""
        now = time.monotonic()
        still = set(missing)
        for gap in looked_at:
            if gap not in still or now - self._gaps[gap] > GAP_WAIT_S:
                del self._gaps[gap]
        for gap in missing:
            if gap not in self._gaps and len(self._gaps) < MAX_GAPS:
                self._gaps[gap] = now

    def _claim(self, now: datetime, limits: Limits, wrap: bool) -> Claimed:
        """A claim from the cursor; when it locks nothing, the next users at once: those after
        it when every due user it found was being claimed by another replica (their locks are
        held for milliseconds), and with ``wrap`` those from the first user when the sweep
        reached the last. The outbox's highest id is the first claim's."""
        after = self._after
        claimed = first = claim(self._conn(), now, limits, after, catalog=self._catalog)
        for _ in range(MAX_EMPTY_CLAIMS):
            if claimed.users_locked:
                break
            if claimed.cursor:
                after = claimed.cursor
            elif after and wrap:
                after = ""
            else:
                break  # a sweep from the first user found nothing due, or this sweep is done
            claimed = claim(self._conn(), now, limits, after, catalog=self._catalog)
        claimed.high = first.high
        return claimed
