"""The run journal (``queries/journal.sql``): a run's steps, appended as they happen.

The rules:

1. **Identity.** A run's key is ``<user>:<first event id>`` (a background task's
   ``task:<id>``), the same across attempts, epochs and workers until its events finish. Each
   step has a position in the run (from 1); the idempotency key of a tool call is
   ``<run key>:<step>`` (``vigil.agent.journal``), never the epoch, the attempt or the model's
   tool_use id, so a retried run hands a tool the key it handed it before.
2. **Fenced appends.** Every append and outcome names the claim's epoch (a task: its lease
   epoch) and holds that row ``FOR SHARE`` to commit, exactly as the finish does
   (:mod:`vigil.ledger.partitions`): a takeover waits for an append in flight, and a stale
   worker's later append writes nothing (:class:`Fenced`: its run stops).
3. **One step, one statement.** A model turn is one insert (its content blocks, usage and
   duration; the first also carries the run's start). An action tool call is an insert before
   it executes (its intent) and an update after (its outcome). A call with an intent and no
   outcome is *in doubt*: the replay executes it again, with the same key.
4. **The finish ends it.** The fenced finish of a done run deletes its journal (the user's
   live journals led by an event the finish made done), or marks it finished when
   ``VIGIL_RUN_JOURNAL_DAYS`` keeps journals for operators (:func:`finish_users`); a failed
   attempt keeps it (the retry replays). The pruner drops kept journals past their days and
   live ones abandoned past the dedup window.
5. **A dead event's journal is parked.** When its lead event goes dead with a call in doubt,
   the journal stays: no later run of the user reads, replays, drops or ends it (its lead is
   not theirs), and an operator's retry (``vigil dead retry``) makes the event pending again,
   so its claim finds the journal and replays the call under the key it had. Only the pruner
   drops a parked journal, past the dedup window; a retry after that starts afresh.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg.rows import DictRow

from vigil.errors import VigilError
from vigil.ledger.partitions import PartitionKey
from vigil.ledger.queries import Q


class Fenced(VigilError):
    """An append or outcome was refused: the claim's epoch (or the task's lease) is no longer
    current. The run must stop: nothing more of it may land."""


@dataclass(frozen=True, slots=True)
class Step:
    """One journaled step, as a replay reads it (``body`` and ``outcome`` as stored JSON text)."""

    step: int
    kind: str  # "model" | "call"
    body: str
    outcome: str | None


@dataclass(frozen=True, slots=True)
class Live:
    """A user's live journal: the key of the run it belongs to and its steps in order;
    ``alone``: its batch was already replayed alone on its lead's last attempt (rule 3)."""

    run_key: str
    steps: list[Step]
    alone: bool = False


class Fence(Protocol):
    """What a journal's writes are fenced by (rule 2): each gives its statements and their
    parameters, so :func:`append` and :func:`outcome` never ask which fence they hold."""

    def append_statement(self, run_key: str, step: int, kind: str, body: str) -> tuple[str, dict[str, Any]]: ...

    def outcome_statement(self, run_key: str, step: int, outcome: str) -> tuple[str, dict[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class RunFence:
    """A run's fence: its claim's home partition and epoch."""

    home: PartitionKey
    epoch: int
    user_id: str
    attempt: int

    def params(self) -> dict[str, Any]:
        return {"topic": self.home.topic, "partition": self.home.partition, "epoch": self.epoch}

    def append_statement(self, run_key: str, step: int, kind: str, body: str) -> tuple[str, dict[str, Any]]:
        params = {"run_key": run_key, "step": step, "kind": kind, "body": body, "user_id": self.user_id}
        return Q.journal_append, {**self.params(), **params, "attempt": self.attempt}

    def outcome_statement(self, run_key: str, step: int, outcome: str) -> tuple[str, dict[str, Any]]:
        return Q.journal_outcome, {**self.params(), "run_key": run_key, "step": step, "outcome": outcome}


@dataclass(frozen=True, slots=True)
class TaskFence:
    """A background task's fence: its id and lease epoch."""

    task_id: str
    epoch: int

    def params(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "epoch": self.epoch}

    def append_statement(self, run_key: str, step: int, kind: str, body: str) -> tuple[str, dict[str, Any]]:
        return Q.journal_task_append, {**self.params(), "run_key": run_key, "step": step, "kind": kind, "body": body}

    def outcome_statement(self, run_key: str, step: int, outcome: str) -> tuple[str, dict[str, Any]]:
        return Q.journal_task_outcome, {**self.params(), "run_key": run_key, "step": step, "outcome": outcome}


@dataclass(frozen=True, slots=True)
class StepRow:
    """A step as operators see it (``vigil runs show``, the console)."""

    run_key: str
    step: int
    kind: str
    user_id: str
    epoch: int
    attempt: int
    body: str
    outcome: str | None
    recorded_at: datetime
    outcome_at: datetime | None
    finished_at: datetime | None

    def view(self) -> dict[str, Any]:
        """The step as operators read it: a model turn's tools called, tokens and duration; a
        call's tool, key and outcome (``in doubt`` while it has none)."""
        body = json.loads(self.body)
        out = {"run_key": self.run_key, "step": self.step, "kind": self.kind, "epoch": self.epoch}
        out |= {"attempt": self.attempt, "recorded_at": self.recorded_at.isoformat()}
        if self.kind == "model":
            usage = body.get("usage") or {}
            out["tools_called"] = [b.get("name") for b in body.get("content", []) if b.get("type") == "tool_use"]
            out["text"] = " ".join(b.get("text", "") for b in body.get("content", []) if b.get("type") == "text")[:500]
            out["input_tokens"] = usage.get("input_tokens", 0)
            out["output_tokens"] = usage.get("output_tokens", 0)
            out["cache_read_tokens"] = usage.get("cache_read_input_tokens", 0)
            out["duration_ms"] = body.get("ms")
            out["folded_event_ids"] = body.get("folded", [])
        else:
            outcome = json.loads(self.outcome) if self.outcome else None
            out |= {"tool": body.get("name"), "idempotency_key": body.get("key")}
            out["outcome"] = "in doubt" if outcome is None else ("error" if outcome.get("is_error") else "ok")
            out["result"] = (outcome or {}).get("text", "")[:500]
        return out


async def live_many_cursor(conn: psycopg.AsyncConnection[DictRow], user_ids: list[str]) -> psycopg.AsyncCursor[DictRow]:
    """The statement reading these users' live journals (for a caller's pipeline); read the
    rows with :func:`live_from`."""
    return await conn.execute(Q.journal_live_many, {"user_ids": user_ids})


async def live_from(cursor: psycopg.AsyncCursor[DictRow]) -> dict[str, list[Live]]:
    """The rows of :func:`live_many_cursor`: each user's live journals, oldest lead first (a
    user has one, or beside it a retried dead event's: the claim picks its own run's)."""
    out: dict[str, list[Live]] = {}
    for row in await cursor.fetchall():
        lives = out.setdefault(row["user_id"], [])
        if not lives or lives[-1].run_key != row["run_key"]:
            lives.append(Live(row["run_key"], [], alone=row.get("alone_at") is not None))
        lives[-1].steps.append(Step(row["step"], row["kind"], row["body"], row["outcome"]))
    return out


async def live_task(conn: psycopg.AsyncConnection[DictRow], run_key: str) -> list[Step]:
    cur = await conn.execute(Q.journal_live_task, {"run_key": run_key})
    return [Step(r["step"], r["kind"], r["body"], r["outcome"]) for r in await cur.fetchall()]


async def append(
    conn: psycopg.AsyncConnection[DictRow],
    fence: Fence,
    *,
    run_key: str,
    step: int,
    kind: str,
    body: str,
) -> None:
    """Append one step (rule 2); raises :class:`Fenced` when the fence no longer holds.
    ``conn`` in autocommit mode: the step is durable when this returns."""
    cur = await conn.execute(*fence.append_statement(run_key, step, kind, body))
    if cur.rowcount != 1:
        raise Fenced(f"journal append of step {step} of {run_key} refused: the fence moved on")


async def outcome(
    conn: psycopg.AsyncConnection[DictRow], fence: Fence, *, run_key: str, step: int, outcome: str
) -> None:
    """Record a call's outcome (rule 3); raises :class:`Fenced` when the fence no longer holds."""
    cur = await conn.execute(*fence.outcome_statement(run_key, step, outcome))
    if cur.rowcount != 1:
        raise Fenced(f"journal outcome of step {step} of {run_key} refused: the fence moved on")


@dataclass(frozen=True, slots=True)
class Pending:
    """One step (or a call's outcome) of a run waiting for a group append."""

    fence: RunFence
    run_key: str
    step: int
    kind: str  # "model" | "call" for an append; "outcome" for a call's outcome
    text: str  # the body, or the outcome


async def append_many(conn: psycopg.AsyncConnection[DictRow], items: list[Pending]) -> set[tuple[str, int]]:
    """Many runs' steps in one statement (rule 2, per step). Returns the (run key, step) pairs
    written; a pair missing was refused (its fence moved on, or the step was already there)."""
    cur = await conn.execute(
        Q.journal_append_many,
        {
            "run_keys": [i.run_key for i in items],
            "steps": [i.step for i in items],
            "kinds": [i.kind for i in items],
            "user_ids": [i.fence.user_id for i in items],
            "topics": [i.fence.home.topic for i in items],
            "partitions": [i.fence.home.partition for i in items],
            "epochs": [i.fence.epoch for i in items],
            "attempts": [i.fence.attempt for i in items],
            "bodies": [i.text for i in items],
        },
    )
    return {(row["run_key"], row["step"]) for row in await cur.fetchall()}


async def outcome_many(conn: psycopg.AsyncConnection[DictRow], items: list[Pending]) -> set[tuple[str, int]]:
    """Many calls' outcomes in one statement (rule 3). Returns the (run key, step) pairs written."""
    cur = await conn.execute(
        Q.journal_outcome_many,
        {
            "run_keys": [i.run_key for i in items],
            "steps": [i.step for i in items],
            "topics": [i.fence.home.topic for i in items],
            "partitions": [i.fence.home.partition for i in items],
            "epochs": [i.fence.epoch for i in items],
            "outcomes": [i.text for i in items],
        },
    )
    return {(row["run_key"], row["step"]) for row in await cur.fetchall()}


async def discard(conn: psycopg.AsyncConnection[DictRow], fence: RunFence, run_key: str) -> int:
    """Drop a live journal its run cannot replay; fenced. Returns the rows dropped."""
    cur = await conn.execute(Q.journal_discard, {**fence.params(), "run_key": run_key})
    return cur.rowcount


async def mark_alone(conn: psycopg.AsyncConnection[DictRow], fence: RunFence, run_key: str) -> bool:
    """Stamp a batch's journal as replayed alone on its lead's last attempt; fenced, once.
    False if it was stamped before (or the fence moved on)."""
    cur = await conn.execute(Q.journal_mark_alone, {**fence.params(), "run_key": run_key})
    return cur.rowcount == 1


async def finish_users(
    conn: psycopg.AsyncConnection[DictRow], user_ids: list[str], event_ids: list[int], *, keep: bool
) -> None:
    """In a finish's transaction (rule 4): the live journals of these users led by one of the
    events it made done end; a parked one (rule 5) and a retried one waiting stay."""
    if user_ids:
        await conn.execute(Q.journal_finish_users, {"user_ids": user_ids, "event_ids": event_ids, "keep": keep})


async def finish_task(conn: psycopg.AsyncConnection[DictRow], run_key: str, *, keep: bool) -> None:
    """With a task's terminal write (rule 4): its journal ends."""
    await conn.execute(Q.journal_finish_task, {"run_key": run_key, "keep": keep})


def steps(conn: psycopg.Connection[DictRow], run_key: str, limit: int = 1000) -> list[StepRow]:
    """A run's steps, live or kept, for operators (``run_key``: ``<user>:<first event id>``)."""
    user_id = run_key.rpartition(":")[0]
    rows = conn.execute(Q.journal_steps, {"run_key": run_key, "user_id": user_id, "limit": limit}).fetchall()
    return [StepRow(**row) for row in rows]


def prune(conn: psycopg.Connection[DictRow], *, keep_days: int, live_days: int, now: datetime | None = None) -> int:
    """Retention (rule 4), judged at ``now`` (the pruner's clock; None: the ledger's). Returns
    the rows dropped."""
    return conn.execute(Q.journal_prune, {"keep_days": keep_days, "live_days": live_days, "now": now}).rowcount
