"""The dispatcher's loop: claim, send in parallel, record the outcomes.

One pass: :func:`vigil.dispatcher.claims.claim` fixes and commits what is due (the next users
of a round robin); the sends run on a thread pool; the outcomes are recorded as they
arrive, the accepted sends that arrived together in one short transaction, each fenced by its
attempt number, so a crash loses at most the outcomes not yet recorded, and those deliveries
are sent again under their own ids once their lease passes. A ledger that goes away after a
send loses nothing: the outcome is kept and recorded as soon as the ledger answers again
(:meth:`Dispatcher.settle`), so the row does not sit ``sending`` for the whole lease. Nothing
here sends anything the ledger has not fixed first.

The passes overlap (:meth:`Dispatcher.run`): the next claim does not wait for the previous
one's sends, only for room, so a receiver that takes its whole timeout holds one send
thread and nobody else's delivery. Claimed deliveries not yet sent never number more than
``VIGIL_DISPATCHER_BATCH_USERS``, the bound the settings check the lease against.

A sweep (claims from the first user to the last) reads every user holding messages; the next
one starts after a pause that the last one's cost sets (:data:`SWEEP_IDLE_FACTOR`), and the
claims in between look only at users with messages written since the loop last looked, users
whose delivery just ended, and users whose gap, backoff or lease the loop saw end
(:class:`Wakeups`: every user a claim looked at and held). Only a user the loop has not seen
since it started (a restart, another replica's) waits for a sweep. Ids below the highest seen
that had no row yet (a transaction that committed after a later one) are looked at again
until they do, for :data:`GAP_WAIT_S`.
"""

from __future__ import annotations

import heapq
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import psycopg
from opentelemetry.trace import SpanKind

from vigil import logs, tracing
from vigil.clock import Clock, utc
from vigil.dispatcher import metrics
from vigil.dispatcher.channels import Channels, Delivery, Outcome, Result
from vigil.dispatcher.claims import (
    ClaimConflict,
    Claimed,
    Limits,
    claim,
    record_dead,
    record_delivered,
    record_retry,
)
from vigil.dispatcher.pacing import retry_delay
from vigil.dispatcher.settings import DispatcherSettings
from vigil.ledger import db, outbox
from vigil.ledger.states import OutboxStatus

log = logging.getLogger("vigil.dispatcher")

# The backlog gauges cost a scan of the undelivered rows: every few seconds is plenty for a
# dashboard and nothing for the database.
BACKLOG_REFRESH_S = 10.0
# After a database error: long enough not to spin on a restarting server.
RECONNECT_PAUSE_S = 2.0
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


def limits_of(settings: DispatcherSettings) -> Limits:
    return Limits(
        default_gap_s=settings.outbox_gap,
        default_urgent_cap=settings.urgent_daily_cap,
        max_attempts=settings.delivery_max_attempts,
        lease_s=settings.delivery_lease_s,
        batch_users=settings.dispatcher_batch_users,
    )


def delivery_span(delivery: Delivery):
    """The span of one delivery attempt: a child of its first message's run (the outbox row's
    stored context), linked to the other messages' runs it joins."""
    parent, links = tracing.parent_and_links(
        tracing.span_context_of({"traceparent": row.traceparent}) for row in delivery.rows
    )
    return tracing.span(
        f"deliver {delivery.channel.type.value}",
        SpanKind.PRODUCER,
        context=parent,
        links=links,
        attributes={
            "vigil.user_id": delivery.user_id,
            "vigil.delivery_id": str(delivery.delivery_id),
            "vigil.delivery.attempt": delivery.attempt,
            "vigil.delivery.messages": len(delivery.rows),
        },
    )


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


@dataclass(slots=True)
class _Pass:
    """One claim's deliveries: ``open`` of them not finished yet."""

    claimed_at: float  # Unix time
    sweep_started: float | None  # the claim ended a sweep: that sweep's start (Unix time)
    open: int


class Dispatcher:
    """Relays the outbox. ``run_pass`` is one claim-send-record cycle (tests drive it directly)."""

    def __init__(
        self,
        settings: DispatcherSettings,
        clock: Clock,
        channels: Channels,
        connect: Callable[[], psycopg.Connection] | None = None,
    ):
        self.settings = settings
        self.clock = clock
        self.channels = channels
        self.limits = limits_of(settings)
        self._connect = connect or (lambda: db.connect(settings.dsn, autocommit=True))
        self._conn: psycopg.Connection | None = None
        self._pool = ThreadPoolExecutor(settings.dispatcher_concurrency, thread_name_prefix="send")
        self._backlog_at = 0.0
        self._after = ""  # the claims' round-robin cursor: the last user of the last full pass
        self._mark: int | None = None  # outbox ids up to this were there for the last sweep or claim
        self._sweep_at = 0.0  # monotonic time the next sweep may start
        self._sweep_started = 0.0  # Unix time the sweep in progress started
        # Sends whose outcome is not recorded yet (the ledger went away after the send).
        self._unrecorded: list[tuple[Delivery, Outcome]] = []
        # Sends waiting for a thread or being sent, with the claim that fixed them.
        self._in_flight: dict[Future[Outcome], tuple[Delivery, _Pass]] = {}
        self._passes: list[_Pass] = []  # claims whose deliveries are not all recorded yet
        # Users whose delivery ended since the last claim between sweeps: messages written
        # while it was in flight were not due then, and may be now.
        self._recheck: set[str] = set()
        # Users seen holding messages not due yet: looked at again when they may be.
        self._wakeups = Wakeups()
        # Outbox ids below the mark that had no row when looked at: id -> when (monotonic).
        self._gaps: dict[int, float] = {}

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        return self._conn

    def run_pass(self) -> int:
        """Claim what is due, send it, record the outcomes. Returns the deliveries attempted.

        Order: the claim commits the delivery ids (and the users' pacing), then the sends
        run, then the outcomes commit as they arrive. A crash after the claim or after a send
        leaves rows ``sending`` under their lease: once it passes they go out again with the
        same ids. A crash after an outcome's commit leaves nothing to redo. :meth:`run` does
        the same without waiting for one claim's sends before the next claim.
        """
        self._settle_left_over()
        claimed, closed_sweep = self._claim_due(self.limits.batch_users, sweep=True)
        self._start(claimed, closed_sweep)
        failed: psycopg.Error | None = None
        while self._in_flight:
            try:
                self._collect(None, record=failed is None)
            except psycopg.Error as exc:
                # The ledger went away mid-pass: the other sends still finish, and their
                # outcomes wait with these for the reconnect.
                failed = exc
        if failed is not None:
            raise failed
        self._finish_passes()
        return len(claimed.deliveries)

    def _settle_left_over(self) -> None:
        """First what earlier sends could not record (the ledger went away)."""
        left_over = len(self._unrecorded)
        self.settle()
        metrics.SETTLED_AFTER_RECONNECT.inc(left_over)

    def _claim_due(self, users: int, sweep: bool = False) -> tuple[Claimed, float | None]:
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
                claimed = claim(self.conn, now, limits, fresh_after=self._mark, recheck=recheck, gaps=gaps)
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
                pause = min(SWEEP_PAUSE_MAX_S, max(self.settings.dispatcher_poll_interval_s, SWEEP_IDLE_FACTOR * cost))
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

    def _start(self, claimed: Claimed, closed_sweep: float | None) -> None:
        """Hand a claim's deliveries to the send threads (in claim order)."""
        claim_pass = _Pass(time.time(), closed_sweep, len(claimed.deliveries))
        self._passes.append(claim_pass)
        for delivery in claimed.deliveries:
            self._in_flight[self._pool.submit(self._send, delivery)] = (delivery, claim_pass)

    def _collect(self, timeout: float | None, record: bool = True) -> None:
        """Wait up to ``timeout`` for sends to finish (none: until one does), then record every
        outcome that has arrived: the accepted ones together (one statement and one commit),
        since one round trip per outcome was most of a pass."""
        if self._in_flight:
            done, _ = wait(self._in_flight, timeout=timeout, return_when=FIRST_COMPLETED)
            for future in done:
                delivery, claim_pass = self._in_flight.pop(future)
                claim_pass.open -= 1
                self._unrecorded.append((delivery, future.result()))
        if record:
            self.settle()
            self._finish_passes()

    def _finish_passes(self) -> None:
        """A claim is a finished pass once its deliveries and those of every claim before it
        are recorded (so they finish in claim order): the heartbeat is the newest such claim's
        time. A sweep is finished with its closing claim: its start is the sweep gauge, so a
        value after a moment means everything due at that moment was claimed, sent and
        recorded."""
        while self._passes and self._passes[0].open == 0:
            done = self._passes.pop(0)
            metrics.LAST_PASS.set(done.claimed_at)
            if done.sweep_started is not None:
                metrics.LAST_SWEEP.set(done.sweep_started)

    def _claim(self, now: datetime, limits: Limits, wrap: bool) -> Claimed:
        """A claim from the cursor; when it locks nothing, the next users at once: those after
        it when every due user it found was being claimed by another replica (their locks are
        held for milliseconds), and with ``wrap`` those from the first user when the sweep
        reached the last. The outbox's highest id is the first claim's."""
        after = self._after
        claimed = first = claim(self.conn, now, limits, after)
        for _ in range(MAX_EMPTY_CLAIMS):
            if claimed.users_locked:
                break
            if claimed.cursor:
                after = claimed.cursor
            elif after and wrap:
                after = ""
            else:
                break  # a sweep from the first user found nothing due, or this sweep is done
            claimed = claim(self.conn, now, limits, after)
        claimed.high = first.high
        return claimed

    def settle(self) -> None:
        """Record the outcomes of sends this dispatcher made but could not record yet (the ledger
        went away after the send). Called as soon as the ledger answers again, before the next
        claim: the rows leave ``sending`` now instead of after their lease, and a user's newer
        messages stop waiting behind them. Each record is fenced by the attempt number, so an
        outcome whose lease another dispatcher took over in the meantime is dropped. Accepted
        sends are recorded together, the others one by one."""
        while self._unrecorded:
            batch = self._next_batch()
            try:
                self.record_many(batch)
            except psycopg.OperationalError:
                raise  # the ledger is away: kept for the reconnect
            except psycopg.Error:
                del self._unrecorded[: len(batch)]  # refused, not unreachable: the lease sends them again
                raise
            del self._unrecorded[: len(batch)]

    def _next_batch(self) -> list[tuple[Delivery, Outcome]]:
        """The accepted sends at the head of the unrecorded ones (each delivery once), or the
        first outcome alone."""
        batch: list[tuple[Delivery, Outcome]] = []
        ids: set = set()
        for delivery, outcome in self._unrecorded:
            if outcome.result is not Result.DELIVERED or delivery.delivery_id in ids:
                break
            batch.append((delivery, outcome))
            ids.add(delivery.delivery_id)
        return batch or self._unrecorded[:1]

    def _send(self, delivery: Delivery) -> Outcome:
        # The attempt's time is taken when the send starts, not when it was queued: a
        # webhook's timestamp must be fresh when the receiver checks it.
        if not tracing.enabled:
            return self.channels.send(delivery, utc(self.clock.now()))
        with delivery_span(delivery) as span:
            outcome = self.channels.send(delivery, utc(self.clock.now()))
            span.set_attribute("vigil.delivery.result", outcome.result.value)
            if outcome.result is not Result.DELIVERED:
                tracing.failed(span, outcome.error)
            return outcome

    def record(self, delivery: Delivery, outcome: Outcome) -> None:
        """Write one attempt's outcome (the send already happened; this is the commit after it)."""
        self.record_many([(delivery, outcome)])

    def record_many(self, batch: list[tuple[Delivery, Outcome]]) -> None:
        """Write attempts' outcomes: accepted ones together (one statement, one commit), any
        other alone."""
        if batch[0][1].result is Result.DELIVERED:
            self._record_delivered([delivery for delivery, _ in batch])
            return
        ((delivery, outcome),) = batch
        with logs.context(user_id=delivery.user_id):  # every line about it names the user
            self._record(delivery, outcome)

    def _record_delivered(self, deliveries: list[Delivery]) -> None:
        if self.settings.dispatcher_crash_after_send:
            log.warning(
                "test hook: SIGKILL after delivery %s was accepted, before the commit", deliveries[0].delivery_id
            )
            os.kill(os.getpid(), signal.SIGKILL)
        now = utc(self.clock.now())
        for delivery, recorded in zip(deliveries, record_delivered(self.conn, deliveries, now), strict=True):
            self._recheck.add(delivery.user_id)
            channel = delivery.channel.type.value
            with logs.context(user_id=delivery.user_id):
                if not recorded.stood:
                    self._superseded(delivery, Result.DELIVERED)
                    continue
                metrics.DELIVERIES.labels(channel, Result.DELIVERED.value).inc()
                for created_at in recorded.created_at:
                    metrics.LATENCY.labels(channel).observe(max(0.0, (now - created_at).total_seconds()))
                log.debug(
                    "delivered %s to %s (%d messages)", delivery.delivery_id, delivery.user_id, len(delivery.rows)
                )

    def _superseded(self, delivery: Delivery, result: Result) -> None:
        metrics.SUPERSEDED.labels(delivery.channel.type.value).inc()
        log.warning(
            "delivery %s attempt %d: outcome %s dropped, the lease was taken over (it went out again)",
            delivery.delivery_id,
            delivery.attempt,
            result,
        )

    def _record(self, delivery: Delivery, outcome: Outcome) -> None:
        """A failed attempt's outcome: a retry after a backoff, or dead."""
        self._recheck.add(delivery.user_id)
        channel = delivery.channel.type.value
        now = utc(self.clock.now())
        if outcome.result is Result.RETRY and delivery.attempt < self.limits.max_attempts:
            delay = retry_delay(
                delivery.attempt,
                self.settings.delivery_backoff_base_s,
                self.settings.delivery_backoff_cap_s,
                outcome.retry_after_s,
            )
            recorded = record_retry(self.conn, delivery, now + timedelta(seconds=delay), outcome.error or "failed")
            if recorded.stood:
                metrics.RETRIES.labels(channel, "failed").inc()
                log.info(
                    "delivery %s to %s: attempt %d failed (%s), next in %.0fs",
                    delivery.delivery_id,
                    delivery.user_id,
                    delivery.attempt,
                    outcome.error,
                    delay,
                )
        else:
            exhausted = outcome.result is Result.RETRY
            reason = "exhausted" if exhausted else "rejected"
            error = (
                f"{outcome.error}; dead after {delivery.attempt} attempts"
                if exhausted
                else (outcome.error or "rejected")
            )
            recorded = record_dead(self.conn, delivery, now, error)
            if recorded.stood:
                metrics.DEAD.labels(channel, reason).inc()
                metrics.DELIVERIES.labels(channel, Result.DEAD.value).inc()
                log.warning("delivery %s to %s is dead: %s", delivery.delivery_id, delivery.user_id, error)
        if not recorded.stood:
            self._superseded(delivery, outcome.result)

    def refresh_backlog(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._backlog_at < BACKLOG_REFRESH_S:
            return
        self._backlog_at = time.monotonic()
        counts = {OutboxStatus.PENDING.value: 0, OutboxStatus.SENDING.value: 0}
        oldest: datetime | None = None
        for row in outbox.backlog(self.conn):
            counts[row.status] = row.messages
            oldest = row.oldest if oldest is None else min(oldest, row.oldest)
        for status, count in counts.items():
            metrics.BACKLOG.labels(status).set(count)
        age = 0.0 if oldest is None else max(0.0, self.clock.now() - oldest.timestamp())
        metrics.OLDEST_AGE.set(age)

    def run(self, stopping: threading.Event, on_health: Callable[[bool], None] = lambda ok: None) -> None:
        """Passes until ``stopping`` is set; the sends in flight then finish and are recorded.

        Unlike :meth:`run_pass` the next claim does not wait for the previous one's sends:
        whenever at least half of ``VIGIL_DISPATCHER_BATCH_USERS`` is free (claimed deliveries
        whose send has not finished count against it) the loop claims that many more users, so
        a receiver that takes its whole timeout holds one send thread, not the deliveries
        behind it. At most ``VIGIL_DISPATCHER_BATCH_USERS`` deliveries are ever waiting or
        being sent, the bound the settings check the lease against. It claims again at once
        when the last claim was full (more may be due) or everything it sent is recorded,
        otherwise after the poll interval.
        """
        poll = self.settings.dispatcher_poll_interval_s
        batch = self.limits.batch_users
        threshold = max(1, batch // 2)
        full = False  # the last claim took as many users as it asked for: more may be due now
        sent = False  # the last claim sent something: claim again once it is all recorded
        claim_at = 0.0  # otherwise claim again at this monotonic time
        while not stopping.is_set() or self._in_flight:
            try:
                room = batch - len(self._in_flight)
                if (
                    not stopping.is_set()
                    and room >= threshold
                    and (full or (sent and not self._in_flight) or time.monotonic() >= claim_at)
                ):
                    self._settle_left_over()
                    claimed, closed_sweep = self._claim_due(room)
                    self._start(claimed, closed_sweep)
                    full = claimed.users_locked >= room
                    sent = bool(claimed.deliveries)
                    claim_at = time.monotonic() + poll
                if stopping.is_set() or batch - len(self._in_flight) < threshold:
                    wait_s = poll  # no claim now: until a send finishes (a poll's time at most)
                elif full:
                    wait_s = 0.0  # claim again at once
                else:  # until a send finishes or the next claim is due
                    wait_s = max(0.0, claim_at - time.monotonic())
                self._collect(wait_s)
                self.refresh_backlog()
                on_health(True)
            except psycopg.Error as exc:
                # The ledger went away (restart, failover) or refused a statement: nothing was
                # sent that it had not fixed, and what was sent but not recorded is recorded
                # after the reconnect or goes out again after its lease. Reconnect and carry
                # on; a bug elsewhere still crashes.
                log.error("ledger error, reconnecting: %s: %s", type(exc).__name__, exc)
                on_health(False)
                self.close_connection()
                stopping.wait(RECONNECT_PAUSE_S)
                continue
            if not self._in_flight and not full and not sent:
                stopping.wait(max(0.0, claim_at - time.monotonic()))

    def close_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.channels.close()
        self.close_connection()
