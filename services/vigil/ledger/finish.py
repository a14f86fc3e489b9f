"""The finish (``queries/finish.sql``): what a run decided, written in one fenced transaction
with its events' new state. The transaction's order (lock the epochs, the group's runs in one
statement, the rest pipelined) is the worker's: see :mod:`vigil.worker.finish`."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from vigil.ledger.partitions import PartitionKey
from vigil.ledger.queries import Q
from vigil.ledger.states import CatchUp, RunOutcome


@dataclass(frozen=True, slots=True)
class RunMessage:
    body: str
    urgent: bool


@dataclass(slots=True)
class RunRecord:
    """One run of a finish group: its ``runs`` row, and (``done``) its events and messages."""

    user_id: str
    home: PartitionKey
    epoch: int
    event_ids: list[int]
    started_at: datetime
    outcome: RunOutcome
    done: bool  # its events become done and its messages are written (not a failed attempt)
    session_id: str | None = None
    error: str | None = None
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    tool_calls: int = 0
    profile: str | None = None  # the agent profile it ran with (None: the default)
    profile_version: int | None = None
    messages: list[RunMessage] = field(default_factory=list)
    # The run's span context (W3C traceparent) when traces are on: its messages carry it.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class RunWritten:
    run_id: int
    done: int  # how many of its events were still claimed under its epoch (and are now done)


_COLUMNS = (
    "user_id",
    "topic",
    "partition",
    "epoch",
    "event_ids",
    "session_id",
    "started_at",
    "outcome",
    "error",
    "turns",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "tool_calls",
    "profile",
    "profile_version",
    "message_user",
    "message_body",
    "message_urgent",
    "message_trace",
    "done_ids",
)


def finish_runs_params(runs: list[RunRecord], worker: str) -> dict[str, Any]:
    """finish_runs' parameters: one array per column, a run per position; messages flat.
    Public for the query-plan tests, which EXPLAIN the statement."""
    params: dict[str, list[Any]] = {name: [] for name in _COLUMNS}
    for run in runs:
        params["user_id"].append(run.user_id)
        params["topic"].append(run.home.topic)
        params["partition"].append(run.home.partition)
        params["epoch"].append(run.epoch)
        params["event_ids"].append("{" + ",".join(str(i) for i in run.event_ids) + "}")
        params["session_id"].append(run.session_id)
        params["started_at"].append(run.started_at)
        params["outcome"].append(run.outcome.value)
        params["error"].append(run.error)
        params["turns"].append(run.turns)
        params["input_tokens"].append(run.input_tokens)
        params["output_tokens"].append(run.output_tokens)
        params["cache_read_tokens"].append(run.cache_read_tokens)
        params["cache_write_tokens"].append(run.cache_write_tokens)
        params["tool_calls"].append(run.tool_calls)
        params["profile"].append(run.profile)
        params["profile_version"].append(run.profile_version)
        if run.done:
            params["done_ids"].extend(run.event_ids)
            for message in run.messages:
                params["message_user"].append(run.user_id)
                params["message_body"].append(message.body)
                params["message_urgent"].append(message.urgent)
                params["message_trace"].append(run.traceparent)
    return {**params, "worker": worker}


async def finish_runs(
    conn: psycopg.AsyncConnection[DictRow], runs: list[RunRecord], worker: str
) -> dict[str, RunWritten]:
    """Every run's audit row, the done runs' events and their outbox rows, in one statement
    for the group; by user (one run per user per group: the caller sees to it)."""
    cur = await conn.execute(Q.finish_runs, finish_runs_params(runs, worker))
    return {row["user_id"]: RunWritten(row["id"], row["done"]) for row in await cur.fetchall()}


async def finish_failed(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    ids: list[int],
    epoch: int,
    run_id: int | None,
    error: str,
    backoff_s: float,
    transient: bool,
    waiting: bool = False,
    now: datetime | None = None,
) -> psycopg.AsyncCursor[DictRow]:
    """A failed attempt's events back to pending with the error and a backoff from ``now`` (a
    transient failure gives its attempt back and counts a transient failure; a ``waiting``
    one, over its daily budget, counts nothing and has no run: ``run_id`` None); only those
    still claimed under ``epoch``.
    Returns the cursor: in pipeline mode its ``rowcount`` (how many moved) is known once the
    pipeline syncs."""
    params = {"ids": ids, "epoch": epoch, "run_id": run_id, "error": error, "backoff_s": backoff_s, "now": now}
    return await conn.execute(Q.finish_failed, params | {"transient": transient, "waiting": waiting})


async def insert_timer(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    user_id: str,
    timer_id: str,
    kind: str,
    due: datetime,
    catch_up: CatchUp,
    payload: dict[str, Any],
    fixed_key: str | None,
    run_id: int | None,
    traceparent: str | None = None,
) -> None:
    """A follow-up or approval expiry set by run ``run_id`` (with its trace context when traces
    are on); re-setting an id replaces a timer not fired yet."""
    await conn.execute(
        Q.insert_timer,
        {
            "id": timer_id,
            "user_id": user_id,
            "kind": kind,
            "due": due,
            "catch_up": str(catch_up),
            "payload": Jsonb(payload),
            "fixed_key": fixed_key,
            "traceparent": traceparent,
            "run_id": run_id,
        },
    )


async def write_memory(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    user_id: str,
    path: str,
    content: str | None,
    run_id: int | None,
    task_id: str | None = None,
) -> None:
    """The memory tool's write by run ``run_id`` or memory review ``task_id`` (None deletes
    the file), audited in ``memory_history`` by the same statement."""
    params = {"user_id": user_id, "path": path, "content": content, "run_id": run_id, "task_id": task_id}
    await conn.execute(Q.delete_memory if content is None else Q.upsert_memory, params)
