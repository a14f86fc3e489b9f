"""The scheduler loop: due timers become events, each occurrence once in the ledger.

One pass (:meth:`Scheduler.run_pass`) is one database transaction:

1. lock up to ``VIGIL_SCHEDULER_BATCH_SIZE`` due timers ``FOR UPDATE SKIP LOCKED``
   (``timers_claim_due``), so replicas take disjoint batches;
2. plan each with :func:`timing.plan` at the pass's instant; an ``approval_expiry`` timer
   instead applies the approval's deadline policy (:func:`approvals.expire`) in this same
   transaction;
3. produce every event of the batch and wait until the broker acknowledged all of them;
4. advance or finish the timers (``timers_apply``), each only if it is still live with the
   due the plan started from;
5. commit.

What a failure leaves behind: anything before the acknowledgement (broker down, a crash)
rolls the transaction back: the timers are still due and the next pass plans them again.
A pass that stops without its connection closing (a frozen host, a partition) holds its
batch until PostgreSQL ends its session after ``VIGIL_SCHEDULER_PASS_IDLE_S`` idle; then
another replica takes the batch, and the frozen pass, thawed, fails at its next statement.
A crash between the acknowledgement and the commit (``VIGIL_SCHEDULER_CRASH_AFTER_PRODUCE``
places one there) leaves events on the topic and the timers unchanged: the next pass
re-produces the same occurrences under the same keys (``<timer id>@<scheduled_for>``), and
the ledger's dedup key (``event_keys``: user_id, source, source_id) drops the copies. (A coalescing timer
whose next occurrence came due meanwhile fires that one too: each occurrence still lands
once.) The loop never starts a run itself; the worker does, from the ledger.

Several ledger shards (``VIGIL_LEDGER_SHARDS``): one :class:`Scheduler` per shard, each with its
own connection, and :func:`run_shards` gives each its turn in one loop. A pass is still one
shard's transaction (no transaction spans two shards); a shard that fails waits out its own
backoff while the others go on (docs/scaling.md, "Shards": why every replica loops over every
shard).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import overload

import psycopg
from opentelemetry.trace import Link, SpanKind
from psycopg.rows import DictRow

from vigil import retry, tracing
from vigil.bus.kafka import EventProducer
from vigil.clock import Clock, SystemClock
from vigil.envelope import Event
from vigil.ledger import approvals
from vigil.ledger import timers as ledger
from vigil.ledger.db import connect
from vigil.ledger.states import TimerKind
from vigil.ledger.timers import TimerRow
from vigil.scheduler import metrics
from vigil.scheduler.dreams import Dreamer
from vigil.scheduler.settings import SchedulerSettings
from vigil.scheduler.timing import Occurrence, TimerSpec, event_key, next_occurrence, plan

log = logging.getLogger("vigil.scheduler")

# The backlog count scans the due index; while a backlog drains, refreshing it every few
# seconds is plenty for a dashboard and keeps the count off the hot path.
BACKLOG_REFRESH_S = 5.0
# With several shards, a shard whose server does not answer (a blackholed host) holds the
# loop at most this long per attempt before the other shards get their turn.
SHARD_CONNECT_TIMEOUT_S = 5


@overload
def _epoch(value: datetime) -> int: ...
@overload
def _epoch(value: None) -> None: ...
def _epoch(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _span(seconds: float) -> str:
    """``3d 0h 10m`` for a log line an operator reads during an incident."""
    whole = int(seconds)
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


@dataclass
class Outcome:
    """What one pass does with one locked timer."""

    row: TimerRow
    events: list[Event] = field(default_factory=list)
    scheduled: list[int] = field(default_factory=list)  # scheduled_for of each event
    next_due: int | None = None  # None: finished
    done: bool = False
    marked_skipped: bool = False
    skipped_occurrences: int = 0
    handled_through: int | None = None
    approval: str | None = None  # what stood after an approval expiry
    set_aside: str | None = None  # why the row could not be planned

    @property
    def labels(self) -> tuple[str, str]:
        return self.row.kind, self.row.catch_up


@dataclass
class PassReport:
    """A committed pass, for the logs and the start-up summary."""

    timers: int = 0
    events: int = 0
    full: bool = False
    by_policy: Counter = field(default_factory=Counter)  # (catch_up, what) -> count
    approvals: Counter = field(default_factory=Counter)

    def add(self, other: PassReport) -> None:
        self.timers += other.timers
        self.events += other.events
        self.by_policy.update(other.by_policy)
        self.approvals.update(other.approvals)

    def summary(self) -> str:
        parts = []
        for policy in ("coalesce", "each", "skip"):
            timers = self.by_policy[(policy, "timers")]
            if timers:
                parts.append(
                    f"{policy}: {timers} timer(s) -> {self.by_policy[(policy, 'events')]} event(s), "
                    f"{self.by_policy[(policy, 'skipped')]} occurrence(s) skipped"
                )
        if self.by_policy[("*", "one_offs_skipped")]:
            parts.append(f"{self.by_policy[('*', 'one_offs_skipped')]} missed one-off(s) marked skipped")
        if self.approvals:
            parts.append("approval expiries: " + ", ".join(f"{n} {what}" for what, n in sorted(self.approvals.items())))
        if self.by_policy[("*", "set_aside")]:
            parts.append(f"{self.by_policy[('*', 'set_aside')]} unplannable timer(s) set aside")
        return "; ".join(parts) or "nothing to do"


def timer_event(row: TimerRow, occurrence: Occurrence, produced_at: datetime, lower_bound: bool = False) -> Event:
    """The event of one occurrence: keyed ``<id>@<scheduled_for>``, or the timer's fixed key."""
    body = {
        "timer_id": row.id,
        "scheduled_for": occurrence.scheduled_for,
        "late_by": occurrence.late_by,
        "skipped": occurrence.skipped,
        "payload": row.payload,
    }
    if lower_bound and occurrence.skipped:
        body["skipped_is_lower_bound"] = True  # a minute-level cron after a very long outage
    # A follow-up resumes the conversation that set it (the agent puts it in the payload).
    named = row.payload.get("session_id") if row.kind == TimerKind.FOLLOWUP else None
    return Event(
        user_id=row.user_id,
        source="timer",
        source_id=row.fixed_key or event_key(row.id, occurrence.scheduled_for),
        kind=f"timer.{row.kind}",
        payload=json.dumps(body, separators=(",", ":")),
        received_at=produced_at,
        occurred_at=_utc(occurrence.scheduled_for),
        session_id=named if isinstance(named, str) and named else None,
    )


@contextlib.contextmanager
def fire_spans(outcomes: list[Outcome]) -> Iterator[None]:
    """Traces on: a span per fired event, its context in the event's headers, ended when the
    pass commits (or marked failed when it rolls back).

    A one-off timer a run set (a follow-up, an approval's expiry) carries that run's context:
    its fire continues the run's trace, since it is the same conversation's next step. A recurring timer's
    occurrences, and timers with no stored context, each start a trace of their own, linked to
    the stored context if there is one.
    """
    if not tracing.enabled:
        yield
        return
    spans = []
    for outcome in outcomes:
        row = outcome.row
        stored = tracing.span_context_of({"traceparent": row.traceparent})
        one_off = row.every_seconds is None and row.cron is None
        parent, links = tracing.parent_and_links([stored]) if one_off else (None, [Link(stored)] if stored else [])
        for index, event in enumerate(outcome.events):
            span = tracing.started(
                f"fire {event.kind}",
                SpanKind.PRODUCER,
                context=parent,
                links=links,
                attributes={
                    "vigil.user_id": event.user_id,
                    "vigil.timer_id": row.id,
                    "vigil.source_id": event.source_id,
                },
            )
            outcome.events[index] = replace(event, headers={**event.headers, **tracing.carrier(span)})
            spans.append(span)
    try:
        yield
    except BaseException as exc:
        for span in spans:
            tracing.failed(span, f"pass rolled back: {type(exc).__name__}")
        raise
    finally:
        for span in spans:
            span.end()


class Scheduler:
    """Passes over one ledger shard's due timers (``shard``: its index in
    ``VIGIL_LEDGER_SHARDS``, 0 with one shard). ``clock`` decides what "now" is for each pass."""

    def __init__(
        self, settings: SchedulerSettings, producer: EventProducer, clock: Clock | None = None, *, shard: int = 0
    ):
        self.settings = settings
        self.producer = producer
        self.clock = clock or SystemClock()
        self.shard = shard
        self.dsn = settings.shard_dsns[shard]
        self._several = len(settings.shard_dsns) > 1
        self._conn: psycopg.Connection[DictRow] | None = None
        self._backlog_at = 0.0
        self.dreamer = Dreamer(settings, self.clock)
        self.retry_policy = retry.scheduler_pass(settings.scheduler_tick_s)
        self._startup: PassReport | None = None  # the start-up catch-up, while it lasts
        self._counted = False
        self.healthy = True  # the last turn's pass committed (or had nothing to do)

    # -- database ------------------------------------------------------------------------

    def conn(self) -> psycopg.Connection[DictRow]:
        if self._conn is None or self._conn.closed:
            timeout = SHARD_CONNECT_TIMEOUT_S if self._several else None
            # A pass frozen with its batch locked (a stopped host, a partition: the connection
            # stays open) is ended by the server after VIGIL_SCHEDULER_PASS_IDLE_S, so another
            # replica takes the batch; thawed, this pass's commit fails and nothing of it lands.
            idle_ms = self.settings.scheduler_pass_idle_s * 1000
            self._conn = connect(self.dsn, autocommit=True, connect_timeout=timeout, idle_in_transaction_ms=idle_ms)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def backlog(self) -> tuple[int, int | None]:
        """Due live timers now (all replicas) and the oldest one's due, as epoch seconds."""
        backlog = ledger.due_backlog(self.conn(), _utc(int(self.clock.now())))
        shard = str(self.shard)
        metrics.DUE_BACKLOG.labels(shard).set(backlog.due)
        oldest = _epoch(backlog.oldest)
        metrics.OLDEST_DUE.labels(shard).set(max(0.0, self.clock.now() - oldest) if oldest is not None else 0)
        self._backlog_at = time.monotonic()
        return backlog.due, oldest

    # -- planning ------------------------------------------------------------------------

    def _plan(self, conn: psycopg.Connection[DictRow], row: TimerRow, now: int) -> Outcome:
        if row.kind == TimerKind.APPROVAL_EXPIRY:
            return self._expire(conn, row, now)
        try:
            spec = TimerSpec(
                due=_epoch(row.due),
                every=row.every_seconds,
                cron=row.cron,
                tz=row.tz,
                catch_up=row.catch_up,
                max_lateness=row.max_lateness,
            )
        except (ValueError, TypeError) as exc:
            return Outcome(row, set_aside=f"cannot plan: {exc}")
        floor = _epoch(row.handled_through)
        if floor is not None and spec.due <= floor:
            # Revived with an old due (a cancelled schedule re-registered): occurrences up
            # to handled_through were fired or passed over once already.
            lifted = next_occurrence(spec.recurrence, floor)
            if lifted is None:
                return Outcome(row, done=True)
            if lifted > now:
                return Outcome(row, next_due=lifted)
            spec = replace(spec, due=lifted)
        result = plan(spec, now, self.settings.scheduler_grace_s, self.settings.scheduler_each_cap)
        produced_at = _utc(now)
        return Outcome(
            row,
            events=[timer_event(row, o, produced_at, result.skipped_is_lower_bound) for o in result.fire],
            scheduled=[o.scheduled_for for o in result.fire],
            next_due=result.next_due,
            done=result.finished,
            marked_skipped=result.marked_skipped,
            skipped_occurrences=result.skipped_total,
            # A one-off's only occurrence is its due; a schedule has handled all up to now.
            handled_through=now if spec.recurrence is not None else spec.due,
        )

    def _expire(self, conn: psycopg.Connection[DictRow], row: TimerRow, now: int) -> Outcome:
        """An approval's deadline: the policy decides, and the session wakes either way."""
        request_id = (row.payload or {}).get("request_id") or row.fixed_key or row.id
        due = row.due
        standing = approvals.expire(
            conn, request_id, at=due, escalate_after=timedelta(seconds=self.settings.scheduler_escalate_after_s)
        )
        if standing.answer == approvals.UNKNOWN:
            log.warning("approval expiry timer %s: no approval request %s; finishing it", row.id, request_id)
            return Outcome(row, done=True, approval="unknown", handled_through=_epoch(due))
        if standing.answer == "pending" and not standing.escalated and standing.due is not None:
            # The approval's deadline is later than this timer (moved by hand): wait for it.
            return Outcome(row, next_due=math.ceil(standing.due.timestamp()), approval="not_yet_due")
        outcome = Outcome(
            row,
            events=[approvals.wake_event(standing, received_at=_utc(now))],
            scheduled=[_epoch(due)],
            handled_through=_epoch(due),
        )
        if standing.escalated and standing.due is not None:
            # Asked again, louder: the same timer expires the second deadline.
            outcome.next_due, outcome.approval = math.ceil(standing.due.timestamp()), "escalated"
        else:
            outcome.done, outcome.approval = True, standing.answer
        return outcome

    # -- one pass ------------------------------------------------------------------------

    def run_pass(self) -> PassReport:
        """Lock, plan, produce (acknowledged), advance, commit: see the module docstring."""
        started = time.perf_counter()
        now = int(self.clock.now())
        batch = self.settings.scheduler_batch_size
        conn = self.conn()
        with conn.transaction():
            rows = ledger.claim_due(conn, _utc(now), batch)
            outcomes = [self._plan(conn, row, now) for row in rows]
            with fire_spans(outcomes):
                events = [event for outcome in outcomes for event in outcome.events]
                if events:
                    self.producer.send(events)
                acked_at = self.clock.now()
                if events and self.settings.scheduler_crash_after_produce:
                    log.warning(
                        "test hook: SIGKILL after the broker acknowledged %d event(s), before commit", len(events)
                    )
                    os.kill(os.getpid(), signal.SIGKILL)
                self._apply(conn, outcomes, now)
        report = self._account(outcomes, acked_at)
        report.full = len(rows) == batch
        metrics.PASS_SECONDS.observe(time.perf_counter() - started)
        return report

    def _apply(self, conn: psycopg.Connection[DictRow], outcomes: list[Outcome], now: int) -> None:
        planned = [o for o in outcomes if o.set_aside is None]
        for o in outcomes:
            if o.set_aside is not None:
                ledger.set_aside(conn, o.row, o.set_aside)
        if not planned:
            return
        advances = [
            ledger.Advance(
                user_id=o.row.user_id,
                id=o.row.id,
                expected_due=o.row.due,
                next_due=None if o.next_due is None else _utc(o.next_due),
                done=o.done,
                skipped=o.marked_skipped,
                fired=len(o.events),
                handled_through=None if o.handled_through is None else _utc(o.handled_through),
            )
            for o in planned
        ]
        updated = ledger.apply(conn, _utc(now), advances)
        if updated != len(planned):
            # The rows are locked by this transaction, so only a bug gets here; rolling back
            # leaves them due rather than committing a pass that lost track of some.
            raise RuntimeError(f"timers_apply advanced {updated} of {len(planned)} locked timers")

    def _account(self, outcomes: list[Outcome], acked_at: float) -> PassReport:
        report = PassReport(timers=len(outcomes))
        for o in outcomes:
            kind, policy = o.labels
            if o.set_aside is not None:
                metrics.TIMERS_SET_ASIDE.inc()
                report.by_policy[("*", "set_aside")] += 1
                log.error("timer %r of user %r set aside: %s", o.row.id, o.row.user_id, o.set_aside)
                continue
            if o.approval is not None:
                metrics.APPROVAL_EXPIRIES.labels(o.approval).inc()
                report.approvals[o.approval] += 1
            else:
                report.by_policy[(policy, "timers")] += 1
                report.by_policy[(policy, "events")] += len(o.events)
                report.by_policy[(policy, "skipped")] += o.skipped_occurrences
                report.by_policy[("*", "one_offs_skipped")] += int(o.marked_skipped)
            report.events += len(o.events)
            if o.events:
                metrics.EVENTS_FIRED.labels(kind, policy).inc(len(o.events))
            if o.skipped_occurrences:
                metrics.OCCURRENCES_SKIPPED.labels(kind, policy).inc(o.skipped_occurrences)
            for scheduled_for in o.scheduled:
                metrics.LATENESS.labels(kind).observe(max(0.0, acked_at - scheduled_for))
        return report

    # -- the service loop ----------------------------------------------------------------

    def run(self, stopping: threading.Event, on_health=lambda ok: None) -> None:
        """This shard alone until ``stopping`` (:func:`run_shards` with one scheduler)."""
        run_shards([self], stopping, on_health)

    def turn(self) -> float:
        """One pass on this shard; the seconds until its next turn.

        The first passes drain what was overdue at start-up and are summed into one log
        line. A broker or database failure rolls the pass back and this shard waits (doubling,
        up to 30 s, ``retry.scheduler_pass``) before its next attempt; the process never exits
        over it, and the other shards' turns go on meanwhile. A full batch goes again at once.
        """
        where = f"shard {self.shard}: " if self._several else ""
        try:
            if not self._counted:
                overdue, oldest = self.backlog()
                late = f" (oldest due {_span(self.clock.now() - oldest)} ago)" if oldest is not None else ""
                log.info("%sstart-up: %d timer(s) overdue%s", where, overdue, late)
                self._counted, self._startup = True, PassReport()
            report = self.run_pass()
            if self._startup is not None:
                self._startup.add(report)
                if not report.full:
                    log.info(
                        "%sstart-up catch-up done, %d timer(s) handled here: %s",
                        where,
                        self._startup.timers,
                        self._startup.summary(),
                    )
                    self._startup = None
            if not report.full or time.monotonic() - self._backlog_at > BACKLOG_REFRESH_S:
                self.backlog()
            self.dreamer.maybe(self.conn())
        except self.retry_policy.retried as exc:
            # Whatever the pass had not committed rolled back, so retrying is safe. Exiting
            # would only turn a broker or ledger outage into a crash loop.
            reason, backoff = self.retry_policy(exc)
            metrics.PASS_FAILURES.labels(reason).inc()
            log.warning(
                "%spass failed, uncommitted timers stay due (%s): %s; retrying in %.1f s",
                where,
                reason,
                exc,
                backoff,
                exc_info=reason == "error",
                extra={"event": "pass_failed"},
            )
            if reason != "broker":
                self.close()
            self.healthy = False
            metrics.SHARD_UP.labels(str(self.shard)).set(0)
            return backoff
        self.retry_policy.succeeded()
        self.healthy = True
        metrics.SHARD_UP.labels(str(self.shard)).set(1)
        if report.timers:
            log.debug("%spass: %d timer(s), %d event(s)", where, report.timers, report.events)
        return 0.0 if report.full else self.settings.scheduler_tick_s


def run_shards(schedulers: list[Scheduler], stopping: threading.Event, on_health=lambda ok: None) -> None:
    """Every shard's turn when it is due, until ``stopping``: one loop, one shard at a time.

    Each shard keeps its own schedule: a full batch goes again at once, an idle shard waits a
    tick, a failed one its backoff. ``on_health`` hears whether every shard's last pass
    committed: a shard down is a scheduler not fully serving, though the others still are.
    """
    next_at = [0.0] * len(schedulers)
    while not stopping.is_set():
        for index, scheduler in enumerate(schedulers):
            if stopping.is_set():
                return
            if time.monotonic() >= next_at[index]:
                next_at[index] = time.monotonic() + scheduler.turn()
        on_health(all(s.healthy for s in schedulers))
        stopping.wait(max(0.0, min(next_at) - time.monotonic()))
