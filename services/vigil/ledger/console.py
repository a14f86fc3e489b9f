"""The operator console's reads: a connection and typed arguments in, dataclasses out.

The only caller of ``queries/console.sql`` (same stem). Every function is bounded: it
returns at most ``limit`` rows and pages by keyset; the overview's counts stop at ``cap``.
The console's writes are not here: a retry is the operators' own code
(:func:`vigil.ledger.events.retry_dead_events`, :func:`vigil.dispatcher.operator.revive_delivery`),
so the page and the CLI cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from psycopg.rows import DictRow

from vigil.ledger import db
from vigil.ledger.queries import Q
from vigil.numbers import whole_number

# The overview's counts stop here: a backlog this size is an incident whatever its exact
# size, and counting millions of rows would make the page an incident of its own.
COUNT_CAP = 100_000
MAX_BIGINT = 2**63 - 1  # every ledger id is a bigint: a larger number names nothing
# A page that waits longer than this on the ledger is failing; say so rather than hang.
CONSOLE_STATEMENT_TIMEOUT_MS = 5_000
# The far end of every keyset: "before" the end of time, "after" its beginning.
FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)
FAR_PAST = datetime(1970, 1, 1, tzinfo=UTC)
EVENT_KIND, RUN_KIND = 0, 1  # tiebreak of the timeline's merged keyset (same instant: runs first)


def open_pool(dsn: str, max_size: int = 4) -> db.Pool:
    """The console's connections: read-mostly, autocommit, a short statement timeout."""
    # Durable like every ledger session (a retry's audit row); a shorter statement timeout.
    return db.pool(
        dsn,
        name="console",
        max_size=max_size,
        timeout=5,
        autocommit=True,
        statement_timeout_ms=CONSOLE_STATEMENT_TIMEOUT_MS,
    )


T = TypeVar("T")


def _rows(cls: type[T], rows: list[dict[str, Any]]) -> list[T]:
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    return [cls(**{n: row[n] for n in names}) for row in rows]


def _fetch(conn: psycopg.Connection[DictRow], sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    return conn.execute(sql, params).fetchall()


# -- rows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventRow:
    id: int
    user_id: str
    source: str
    source_id: str
    kind: str
    status: str
    attempts: int
    lost_claims: int
    claim_epoch: int | None
    error: str | None
    received_at: datetime
    finished_at: datetime | None
    run_id: int | None


@dataclass(frozen=True)
class EventDetail(EventRow):
    payload: str
    headers: str
    session_id: str | None
    next_attempt_at: datetime | None
    retried_by: str | None
    retried_at: datetime | None
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None


@dataclass(frozen=True)
class RunRow:
    id: int
    user_id: str
    epoch: int
    worker: str
    event_ids: list[int]
    started_at: datetime
    finished_at: datetime
    outcome: str
    error: str | None
    turns: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    tool_calls: int

    @property
    def duration_s(self) -> float:
        return (self.finished_at - self.started_at).total_seconds()

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens + self.cache_read_tokens + self.cache_write_tokens


@dataclass(frozen=True)
class RunDetail(RunRow):
    topic: str
    partition: int
    session_id: str | None
    profile: str | None = None  # the agent profile it ran with (None: the default)
    profile_version: int | None = None


@dataclass(frozen=True)
class OutboxRow:
    id: int
    user_id: str
    run_id: int
    epoch: int
    body: str
    urgent: bool
    created_at: datetime
    status: str
    delivery_id: UUID | None
    attempts: int
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    dead_at: datetime | None
    channel: str | None
    error: str | None


@dataclass(frozen=True)
class ApprovalRow:
    request_id: str
    user_id: str
    run_id: int | None
    tool: str
    due: datetime
    on_expiry: str
    escalations: int
    answer: str | None
    answered_at: datetime | None
    received_at: datetime | None
    created_at: datetime


@dataclass(frozen=True)
class TimerRow:
    id: str
    user_id: str
    kind: str
    due: datetime
    every_seconds: int | None
    cron: str | None
    tz: str
    catch_up: str
    done: bool
    fired_count: int
    last_fired_at: datetime | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class TimerSet(TimerRow):
    run_id: int


@dataclass(frozen=True)
class MemoryWrite:
    path: str
    bytes: int
    updated_at: datetime
    run_id: int


@dataclass(frozen=True)
class PartitionRow:
    topic: str
    partition: int
    epoch: int | None  # None: never assigned (the ledger recorded from it, or a user's home)
    holder: str | None
    acquired_at: datetime | None
    handover_until: datetime | None  # revoked, its runs finishing on the holder until then (fencing rule 4)
    next_offset: int | None  # the ledger's consumer position: every offset before it is recorded
    recorded_at: datetime | None  # when that position last moved
    pending: int  # pending events whose user's home is this partition
    pending_capped: bool  # the pending count stopped at COUNT_CAP (over all partitions)


@dataclass(frozen=True)
class UserRow:
    user_id: str
    home_topic: str
    home_partition: int
    first_seen_at: datetime
    last_delivery_at: datetime | None
    attention_gap_s: int | None = None  # the earned gap (docs/agent.md, "Attention"); None: not adapting
    attention_reason: str | None = None


@dataclass(frozen=True)
class PendingEvent:
    id: int
    user_id: str
    source: str
    kind: str
    attempts: int
    received_at: datetime


@dataclass(frozen=True)
class Overview:
    pending: int  # capped at COUNT_CAP
    oldest_pending: datetime | None
    runs_per_minute: list[tuple[datetime, int]]  # the last few minutes, oldest first
    dead_events_last_hour: int
    dead_outbox_rows_last_hour: int
    undelivered: int
    oldest_undelivered: datetime | None
    oldest_undelivered_user: str | None
    oldest_undelivered_run: int | None
    oldest_pending_events: list[PendingEvent]
    recent_runs: list[RunRow]
    approvals_open: int
    approvals_late: int  # open past their deadline: the expiry timer has not answered them yet
    timers_late: int  # live timers past due: the scheduler is behind or down
    cap: int = COUNT_CAP


@dataclass(frozen=True)
class RunWrites:
    """What one run wrote besides its events' new state."""

    outbox: list[OutboxRow]
    approvals: list[ApprovalRow]
    timers: list[TimerSet]
    memory: list[MemoryWrite]
    tasks: list[DelegatedTask]


@dataclass(frozen=True)
class OperatorAction:
    """An audited retry or revival, as `vigil dead retry` / `vigil outbox --revive` or the console wrote it."""

    id: int
    at: datetime
    actor: str
    action: str
    detail: str  # JSON: the ids asked for and those changed


@dataclass(frozen=True)
class Cursor:
    """A keyset position: (time, kind, id) as the page's order compares it."""

    t: datetime
    k: int
    i: int

    def encode(self) -> str:
        return f"{self.t.isoformat()}~{self.k}~{self.i}"

    @classmethod
    def decode(cls, text: str | None) -> Cursor | None:
        """None for a missing or malformed cursor (the first page)."""
        if not text:
            return None
        try:
            t, k, i = text.split("~")
            # ASCII digits within bigint (a larger id was a 500 from the ledger, issue 46).
            return cls(datetime.fromisoformat(t), whole_number(k, 0, MAX_BIGINT), whole_number(i, 0, MAX_BIGINT))
        except ValueError:
            return None


@dataclass(frozen=True)
class TaskRow:
    """A task (background, or a sync child) as the timeline shows it (docs/tasks.md)."""

    id: str
    status: str
    attempts: int
    max_attempts: int
    depth: int
    lease_holder: str | None
    lease_epoch: int
    heartbeat_at: datetime | None
    deadline: datetime
    created_at: datetime
    finished_at: datetime | None
    cancel_requested_by: str | None
    instructions: str
    result: str | None
    error: str | None
    tokens: int
    parent_run_key: str
    reported_at: datetime | None
    mode: str  # background | sync
    parent_task_id: str | None  # the task that delegated it (None: a run did)


@dataclass(frozen=True)
class DelegatedTask(TaskRow):
    run_id: int


@dataclass(frozen=True)
class TimelineEntry:
    at: datetime
    event: EventRow | None = None
    run: RunRow | None = None
    writes: RunWrites | None = None


@dataclass(frozen=True)
class Timeline:
    user: UserRow | None
    entries: list[TimelineEntry]  # newest first: events (by receive time) and runs (by start)
    next: Cursor | None  # the keyset of the next (older) page; None on the last


# -- overview ----------------------------------------------------------------------------


def overview(conn: psycopg.Connection[DictRow], *, now: datetime, minutes: int = 5, limit: int = 10) -> Overview:
    """The numbers an on-call person checks first, each read with a bounded scan."""
    backlog = _fetch(conn, Q.console_pending_backlog, {"cap": COUNT_CAP})[0]
    oldest = _fetch(conn, Q.console_oldest_pending, {"cap": COUNT_CAP, "limit": limit})
    per_minute = _fetch(conn, Q.console_runs_per_minute, {"cap": COUNT_CAP, "minutes": minutes})
    dead = _fetch(conn, Q.console_dead_since, {"since": now - timedelta(hours=1), "cap": COUNT_CAP})[0]
    outbox = _fetch(conn, Q.console_outbox_backlog, {"cap": COUNT_CAP})[0]
    recent = _fetch(conn, Q.console_recent_runs, {"limit": limit})
    waiting = _fetch(conn, Q.console_waiting_on_time, {"now": now, "cap": COUNT_CAP})[0]
    return Overview(
        pending=backlog["pending"],
        oldest_pending=backlog["oldest"],
        runs_per_minute=[(r["minute"], r["runs"]) for r in per_minute],
        dead_events_last_hour=dead["dead_events"],
        dead_outbox_rows_last_hour=dead["dead_outbox_rows"],
        undelivered=outbox["undelivered"],
        oldest_undelivered=outbox["oldest"],
        oldest_undelivered_user=outbox["oldest_user"],
        oldest_undelivered_run=outbox["oldest_run"],
        oldest_pending_events=_rows(PendingEvent, oldest),
        recent_runs=_rows(RunRow, recent),
        approvals_open=waiting["approvals_open"],
        approvals_late=waiting["approvals_late"],
        timers_late=waiting["timers_late"],
    )


# -- a user's timeline -------------------------------------------------------------------


def user(conn: psycopg.Connection[DictRow], user_id: str) -> UserRow | None:
    rows = _rows(UserRow, _fetch(conn, Q.console_user_seen, {"user_id": user_id}))
    return rows[0] if rows else None


def run_writes(conn: psycopg.Connection[DictRow], runs: list[RunRow], limit: int = 500) -> dict[int, RunWrites]:
    """What each of ``runs`` (one user's) wrote, by run id: outbox rows, approvals, timers,
    memory files and background tasks. A timer or memory file that a later run (or the API)
    wrote again belongs to that later write only: the row holds the latest state."""
    if not runs:
        return {}
    ids = [r.id for r in runs]
    user_id = runs[0].user_id
    assert all(r.user_id == user_id for r in runs), "run_writes takes one user's runs"
    params = {"user_id": user_id, "run_ids": ids, "limit": limit}
    outbox = _rows(OutboxRow, _fetch(conn, Q.console_outbox_of_runs, params))
    approvals = _rows(ApprovalRow, _fetch(conn, Q.console_approvals_of_runs, params))
    timers = _rows(TimerSet, _fetch(conn, Q.console_timers_of_runs, params))
    memory = _rows(MemoryWrite, _fetch(conn, Q.console_memory_of_runs, params))
    tasks = _rows(DelegatedTask, _fetch(conn, Q.console_tasks_of_runs, params))
    return {
        run.id: RunWrites(
            outbox=[o for o in outbox if o.run_id == run.id],
            approvals=[a for a in approvals if a.run_id == run.id],
            timers=[t for t in timers if t.run_id == run.id],
            memory=[m for m in memory if m.run_id == run.id],
            tasks=[k for k in tasks if k.run_id == run.id],
        )
        for run in runs
    }


def tasks_of_user(conn: psycopg.Connection[DictRow], user_id: str, limit: int = 20) -> list[TaskRow]:
    """The user's latest background tasks, whatever their state."""
    return _rows(TaskRow, _fetch(conn, Q.console_tasks_of_user, {"user_id": user_id, "limit": limit}))


def timeline(
    conn: psycopg.Connection[DictRow], user_id: str, before: Cursor | None = None, limit: int = 50
) -> Timeline:
    """A user's events and runs merged newest first, each run with what it wrote.

    One page is ``limit`` entries before ``before``; the order is (time, kind, id)
    descending, where an event's time is its receive time and a run's its start.
    """
    at = before or Cursor(FAR_FUTURE, RUN_KIND + 1, 0)
    params = {"user_id": user_id, "t": at.t, "k": at.k, "i": at.i, "limit": limit + 1}
    events = _rows(EventRow, _fetch(conn, Q.console_user_events_page, params))
    runs = _rows(RunRow, _fetch(conn, Q.console_user_runs_page, params))
    # (time, kind, id, row): the row is an EventRow or a RunRow, as its kind says.
    merged: list[tuple[datetime, int, int, Any]] = sorted(
        [(e.received_at, EVENT_KIND, e.id, e) for e in events] + [(r.started_at, RUN_KIND, r.id, r) for r in runs],
        key=lambda x: (x[0], x[1], x[2]),
        reverse=True,
    )
    page, rest = merged[:limit], merged[limit:]
    shown_runs = [x[3] for x in page if x[1] == RUN_KIND]
    writes = run_writes(conn, shown_runs)
    entries = [
        TimelineEntry(at=t, event=obj if kind == EVENT_KIND else None)
        if kind == EVENT_KIND
        else TimelineEntry(at=t, run=obj, writes=writes[obj.id])
        for t, kind, _i, obj in page
    ]
    last = page[-1] if page and rest else None
    return Timeline(
        user=user(conn, user_id),
        entries=entries,
        next=Cursor(last[0], last[1], last[2]) if last else None,
    )


# -- one thing by id ---------------------------------------------------------------------


def event(conn: psycopg.Connection[DictRow], event_id: int) -> EventDetail | None:
    rows = _rows(EventDetail, _fetch(conn, Q.console_event, {"id": event_id}))
    return rows[0] if rows else None


def runs_of_event(conn: psycopg.Connection[DictRow], e: EventRow, limit: int = 50) -> list[RunRow]:
    """The runs that took ``e`` (failed attempts and the one that finished it), oldest first."""
    params = {"user_id": e.user_id, "since": e.received_at, "event_id": e.id, "limit": limit}
    return _rows(RunRow, _fetch(conn, Q.console_runs_of_event, params))


def run(conn: psycopg.Connection[DictRow], run_id: int) -> RunDetail | None:
    rows = _rows(RunDetail, _fetch(conn, Q.console_run, {"id": run_id}))
    return rows[0] if rows else None


def run_by_key(conn: psycopg.Connection[DictRow], user_id: str, first_event: int) -> RunDetail | None:
    """The finished run whose key is ``user_id:first_event`` (None: none finished under it)."""
    rows = _rows(RunDetail, _fetch(conn, Q.console_run_by_key, {"user_id": user_id, "first": first_event}))
    return rows[0] if rows else None


def events_by_id(conn: psycopg.Connection[DictRow], ids: list[int], limit: int = 500) -> list[EventRow]:
    return _rows(EventRow, _fetch(conn, Q.console_events_by_id, {"ids": ids, "limit": limit}))


def delivery(conn: psycopg.Connection[DictRow], delivery_id: UUID, limit: int = 500) -> list[OutboxRow]:
    """The outbox rows sent together under one delivery id (empty: no such delivery)."""
    return _rows(OutboxRow, _fetch(conn, Q.console_delivery, {"delivery_id": delivery_id, "limit": limit}))


def events_by_source_id(
    conn: psycopg.Connection[DictRow], *, source_id: str, user_id: str | None = None, limit: int = 50
) -> list[EventRow]:
    """The newest ``limit`` events with this source id: of ``user_id`` whatever their age, or
    of any user among those recorded within the dedup window (their keys name the users:
    index ``event_keys_by_source_id``; older keys are deleted by retention)."""
    params = {"source_id": source_id, "user_id": user_id, "limit": limit}
    sql = Q.console_events_by_source_id if user_id is None else Q.console_user_events_by_source_id
    return _rows(EventRow, _fetch(conn, sql, params))


# -- lists an operator acts on -----------------------------------------------------------


def dead_events(
    conn: psycopg.Connection[DictRow], before: tuple[datetime, int] | None = None, limit: int = 50
) -> list[EventRow]:
    """Dead events, newest death first, before the keyset ``(finished_at, id)``."""
    t, i = before or (FAR_FUTURE, 0)
    return _rows(EventRow, _fetch(conn, Q.console_dead_events_page, {"t": t, "i": i, "limit": limit}))


def dead_outbox_rows(
    conn: psycopg.Connection[DictRow], before: tuple[datetime, int] | None = None, limit: int = 50
) -> list[OutboxRow]:
    """Dead outbox rows, newest death first, before the keyset ``(dead_at, id)``; rows of one
    delivery share its delivery id (and are revived together)."""
    t, i = before or (FAR_FUTURE, 0)
    return _rows(OutboxRow, _fetch(conn, Q.console_dead_outbox_page, {"t": t, "i": i, "limit": limit}))


def operator_actions(conn: psycopg.Connection[DictRow], limit: int = 20) -> list[OperatorAction]:
    """The latest audited retries of dead events and revivals of dead deliveries."""
    return _rows(OperatorAction, _fetch(conn, Q.console_operator_actions, {"limit": limit}))


def open_approvals(
    conn: psycopg.Connection[DictRow], after: tuple[datetime, str] | None = None, limit: int = 50
) -> list[ApprovalRow]:
    """Approval requests with no answer yet, nearest deadline first."""
    t, i = after or (FAR_PAST, "")
    return _rows(ApprovalRow, _fetch(conn, Q.console_open_approvals, {"t": t, "i": i, "limit": limit}))


def timers_due_before(
    conn: psycopg.Connection[DictRow], until: datetime, after: tuple[datetime, str, str] | None = None, limit: int = 50
) -> list[TimerRow]:
    """Live timers due before ``until``, the latest-overdue first (a due in the past is late)."""
    t, u, i = after or (FAR_PAST, "", "")
    params = {"until": until, "t": t, "u": u, "i": i, "limit": limit}
    return _rows(TimerRow, _fetch(conn, Q.console_timers_due_before, params))


def partitions(conn: psycopg.Connection[DictRow], limit: int = 10_000) -> list[PartitionRow]:
    """Every partition the ledger knows, with its epoch, holder, consumer position and
    pending events (the broker's end offsets are not here: the console asks Kafka)."""
    return _rows(PartitionRow, _fetch(conn, Q.console_partitions, {"limit": limit, "cap": COUNT_CAP}))
