"""Background tasks in the ledger: typed functions over ``queries/tasks.sql``.

The task row is the one authority over a task's life (docs/tasks.md). Every function here
is one statement that checks the state it expects and says whether it won:

- :func:`claim` takes queued tasks for one worker under a new lease epoch;
- :func:`heartbeat` proves the holder alive, and tells it whether it lost the lease or was
  asked to stop;
- :func:`finish` is the holder's compare-and-set to a terminal status (the first terminal
  outcome stands; a previous holder's late result is refused by the lease epoch);
- :func:`reap` times out tasks past their deadline and takes back tasks whose heartbeat is
  too old (their holder is gone), queued again or ``lost`` when attempts are used up;
- :func:`cancel` is the owner's request;
- :func:`unreported` / :func:`mark_reported` are the reporter's two halves around producing
  a terminal task's result event;
- :func:`sync_started` / :func:`sync_ended` record a sync child (mode ``sync``), best effort,
  for its run: visible, never claimed, never reported, not counted as open;
- :func:`children` reads a task's descendants (its tree).

Deadlines are decided on the caller's clock (``now=``); every stamp of a row and the lease on
the ledger's (docs/tasks.md, "One clock per row").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q
from vigil.ledger.states import TaskStatus


@dataclass(frozen=True, slots=True)
class TaskRow:
    id: str
    user_id: str
    parent_run_key: str
    parent_task_id: str | None
    session_id: str | None
    depth: int
    owner_chain: list[str]
    instructions: str
    tools: list[str]
    token_budget: int
    status: TaskStatus
    attempts: int
    max_attempts: int
    lease_holder: str | None
    lease_epoch: int
    heartbeat_at: datetime | None
    deadline: datetime
    cancel_requested_at: datetime | None
    cancel_requested_by: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    result: str | None
    error: str | None
    turns: int
    input_tokens: int
    output_tokens: int
    reported_at: datetime | None
    last_tool: str | None
    note: str | None
    progress_at: datetime | None
    mode: str  # background | sync (a sub-agent run inside its parent's run)
    run_id: int | None  # the run whose finish queued it (a task's background child: that task's run)
    kind: str  # delegated, or memory_review: queued by the scheduler (ledger.dreams)
    profile: str | None  # the delegating run's profile version, which the task runs with (0037)
    profile_version: int | None

    @classmethod
    def of(cls, row: dict[str, Any]) -> TaskRow:
        values = {f.name: row[f.name] for f in fields(cls)}
        values["status"] = TaskStatus(values["status"])
        return cls(**values)

    def as_json(self) -> dict[str, Any]:
        """The task as the HTTP API and ``vigil tasks show --json`` present it."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.isoformat() if isinstance(value, datetime) else value
        out["status"] = str(self.status)
        return out


@dataclass(frozen=True, slots=True)
class NewTaskRow:
    """What a delegating run's finish inserts."""

    id: str
    user_id: str
    parent_run_key: str
    parent_task_id: str | None
    session_id: str | None
    depth: int
    owner_chain: list[str]
    instructions: str
    tools: list[str]
    token_budget: int
    max_attempts: int
    timeout_s: float
    run_id: int | None = None  # the delegating run's row (the console links the task to it)
    profile: str | None = None  # the delegating run's profile version (None: the default)
    profile_version: int | None = None
    # VIGIL_MAX_OPEN_TASKS_PER_USER (None: no bound): past it the task is inserted already
    # failed, with the reason, so its result event tells the agent.
    max_open: int | None = None


@dataclass(frozen=True, slots=True)
class Reaped:
    id: str
    user_id: str
    status: TaskStatus  # queued (taken back), lost or timed_out


@dataclass(frozen=True, slots=True)
class Outcome:
    status: TaskStatus
    result: str | None = None
    error: str | None = None
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    last_tool: str | None = None  # sync rows: the last tool the child called
    note: str | None = None

    def params(self, task_id: str) -> dict[str, Any]:
        """The statement's parameters: the task's id and every field, the status as text."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "id": task_id, "status": str(self.status)}


@dataclass(frozen=True, slots=True)
class Gauges:
    queued: int
    running: int
    heartbeat_age_s: float


async def create(conn: psycopg.AsyncConnection[DictRow], task: NewTaskRow, *, now: datetime | None = None) -> None:
    """Queue a task (its deadline ``timeout_s`` after ``now``): called inside the delegating
    run's fenced finish transaction. With a bound on the user's open tasks, the user's lock is
    taken first (held to the commit), so two finishes of one user count and insert one after
    the other."""
    if task.max_open is not None:
        await conn.execute(Q.task_open_lock, {"user_id": task.user_id})
    await conn.execute(Q.task_create, {**{f.name: getattr(task, f.name) for f in fields(task)}, "now": now})


async def sync_started(
    conn: psycopg.AsyncConnection[DictRow], task: NewTaskRow, *, now: datetime | None = None
) -> None:
    """A sync child starts (its deadline ``timeout_s`` after ``now``: its run's): running, no
    lease. The same id again (a replayed run) starts the same row again, an attempt counted."""
    params = {f.name: getattr(task, f.name) for f in fields(task) if f.name != "max_open"}
    await conn.execute(Q.task_sync_started, {**params, "now": now})


async def sync_ended(conn: psycopg.AsyncConnection[DictRow], *, task_id: str, outcome: Outcome) -> bool:
    """A sync child's end, its usage and answer. False: there is no such sync row."""
    cur = await conn.execute(Q.task_sync_ended, outcome.params(task_id))
    return await cur.fetchone() is not None


async def children(conn: psycopg.AsyncConnection[DictRow], task_id: str, limit: int = 200) -> list[TaskRow]:
    """The task's descendants by ``parent_task_id``, shallowest first."""
    cur = await conn.execute(Q.task_children, {"id": task_id, "limit": limit})
    return [TaskRow.of(row) for row in await cur.fetchall()]


async def open_count(conn: psycopg.AsyncConnection[DictRow], user_id: str) -> int:
    """The user's queued and running tasks."""
    row = await (await conn.execute(Q.task_open_count, {"user_id": user_id})).fetchone()
    assert row is not None  # an aggregate: one row
    return int(row["open"])


async def claim(
    conn: psycopg.AsyncConnection[DictRow], holder: str, limit: int, *, now: datetime | None = None
) -> list[TaskRow]:
    """Up to ``limit`` queued tasks still within their deadline at ``now``, leased to ``holder``."""
    cur = await conn.execute(Q.task_claim, {"holder": holder, "limit": limit, "now": now})
    return [TaskRow.of(row) for row in await cur.fetchall()]


@dataclass(frozen=True, slots=True)
class Progress:
    """What a running task has done so far, flushed with each heartbeat."""

    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    last_tool: str | None = None
    note: str | None = None


async def heartbeat(
    conn: psycopg.AsyncConnection[DictRow], task_id: str, lease_epoch: int, progress: Progress = Progress()
) -> bool | None:
    """Proof of life, stamped on the ledger's clock as it arrives (the lease is judged on that
    clock alone, whatever the holder's and the reaper's hosts read). None: the lease is gone
    (stop, write nothing). True: cancel requested. False: carry on."""
    params = {
        "id": task_id,
        "lease_epoch": lease_epoch,
        **{f.name: getattr(progress, f.name) for f in fields(progress)},
    }
    cur = await conn.execute(Q.task_heartbeat, params)
    row = await cur.fetchone()
    return None if row is None else bool(row["cancel"])


async def finish(conn: psycopg.AsyncConnection[DictRow], task_id: str, lease_epoch: int, outcome: Outcome) -> bool:
    """True if this outcome stands; False if another one already did (or the lease moved on)."""
    assert outcome.status not in (TaskStatus.QUEUED, TaskStatus.RUNNING)
    cur = await conn.execute(Q.task_finish, {**outcome.params(task_id), "lease_epoch": lease_epoch})
    return await cur.fetchone() is not None


async def release(conn: psycopg.AsyncConnection[DictRow], task_id: str, lease_epoch: int) -> bool:
    """A holder shutting down hands the task back (attempt given back). False: the lease had moved on."""
    cur = await conn.execute(Q.task_release, {"id": task_id, "lease_epoch": lease_epoch})
    return await cur.fetchone() is not None


async def reap(conn: psycopg.AsyncConnection[DictRow], stale_s: float, *, now: datetime | None = None) -> list[Reaped]:
    """Deadlines first (a task past its deadline at ``now``, the caller's clock, is timed_out,
    not retried), then leases with no heartbeat for ``stale_s`` on the ledger's clock, which
    stamped the heartbeats (no host's clock enters a lease)."""
    cur = await conn.execute(Q.task_reap_timed_out, {"now": now})
    reaped = [Reaped(r["id"], r["user_id"], TaskStatus.TIMED_OUT) for r in await cur.fetchall()]
    cur = await conn.execute(Q.task_reap_stale, {"stale_s": stale_s, "now": now})
    reaped += [Reaped(r["id"], r["user_id"], TaskStatus(r["status"])) for r in await cur.fetchall()]
    cur = await conn.execute(Q.task_reap_sync, {"now": now})
    reaped += [Reaped(r["id"], r["user_id"], TaskStatus.LOST) for r in await cur.fetchall()]
    return reaped


async def cancel(conn: psycopg.AsyncConnection[DictRow], *, task_id: str, actor: str) -> TaskRow | None:
    """The owner's cancel. None: the task is unknown or already terminal."""
    cur = await conn.execute(Q.task_cancel, {"id": task_id, "actor": actor})
    row = await cur.fetchone()
    return TaskRow.of(row) if row else None


async def get(conn: psycopg.AsyncConnection[DictRow], task_id: str) -> TaskRow | None:
    cur = await conn.execute(Q.task_get, {"id": task_id})
    row = await cur.fetchone()
    return TaskRow.of(row) if row else None


async def of_user(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    user_id: str,
    status: str | None = None,
    before: datetime | None = None,
    limit: int = 50,
) -> list[TaskRow]:
    cur = await conn.execute(Q.tasks_of_user, {"user_id": user_id, "status": status, "before": before, "limit": limit})
    return [TaskRow.of(row) for row in await cur.fetchall()]


def may_own(task: TaskRow, owners: Sequence[str]) -> bool:
    """The owner-chain rule (docs/tasks.md, "Ownership"): a caller whose owner ids (the user,
    over HTTP or the CLI; a run's conversation and run key, for its agent tools) include the
    task's creator or any owner in the task's chain may read, wait for and cancel it. The
    session_id column is recorded, never consulted. (``tasks_of_owner`` applies it in SQL.)"""
    return bool(set(owners) & {task.parent_run_key, *task.owner_chain})


async def of_owner(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    user_id: str,
    owners: Sequence[str],
    task_id: str | None = None,
    limit: int = 20,
) -> list[TaskRow]:
    """The tasks of ``user_id`` that a caller with these owner ids may see (:func:`may_own`),
    newest first; with ``task_id``, that one or none."""
    params = {"user_id": user_id, "owners": list(owners), "id": task_id, "limit": limit}
    cur = await conn.execute(Q.tasks_of_owner, params)
    return [TaskRow.of(row) for row in await cur.fetchall()]


async def recent(conn: psycopg.AsyncConnection[DictRow], status: str | None = None, limit: int = 50) -> list[TaskRow]:
    cur = await conn.execute(Q.tasks_recent, {"status": status, "limit": limit})
    return [TaskRow.of(row) for row in await cur.fetchall()]


async def unreported(conn: psycopg.AsyncConnection[DictRow], limit: int) -> list[TaskRow]:
    """Call inside a transaction: the rows stay locked until it ends."""
    cur = await conn.execute(Q.task_unreported, {"limit": limit})
    return [TaskRow.of(row) for row in await cur.fetchall()]


async def mark_reported(conn: psycopg.AsyncConnection[DictRow], ids: list[str]) -> None:
    await conn.execute(Q.task_mark_reported, {"ids": ids})


async def gauges(conn: psycopg.AsyncConnection[DictRow]) -> Gauges:
    """The heartbeat age on the ledger's clock, as the reaper judges it."""
    row = await (await conn.execute(Q.task_gauges)).fetchone()
    assert row is not None  # aggregates only: one row
    return Gauges(row["queued"], row["running"], row["heartbeat_age"])
