"""The Claude agent's reads and writes (``queries/agent.sql``): what a run starts from
(sessions, memory, past messages, policies, dead events, the approvals it resumes), the
saved sessions, the messages' tags, per-user policies, and the demo refund tool's record."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

import psycopg
from psycopg.types.json import Jsonb

from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class ContextWanted:
    """What to read for one run."""

    user_id: str
    session_ids: list[str]  # the sessions its events name, in order
    request_ids: list[str]  # the approval requests its approval events name
    recent_limit: int  # past messages to read (0: none)
    dead_limit: int


@dataclass(frozen=True, slots=True)
class SessionRow:
    """A ``sessions`` row, as saved by a run's finish and read by the next run."""

    id: str
    user_id: str
    state: str
    messages: list[dict]
    size_bytes: int
    blocks: int
    consecutive_blocks: int
    pending: dict | None


@dataclass(frozen=True, slots=True)
class ApprovalLoaded:
    request_id: str
    session_id: str | None
    tool: str
    tool_use_id: str
    args_hash: str
    answer: str | None


@dataclass(slots=True)
class ContextRows:
    """What :func:`load_contexts` read for one run (``None``: not asked for)."""

    sessions: dict[str, SessionRow] | None = None
    memory: dict[str, str] = field(default_factory=dict)
    recent: list[tuple[str, bool]] | None = None  # (body, still queued), oldest first
    event_policies: str = ""
    dead_events: list[dict] = field(default_factory=list)
    approvals: list[ApprovalLoaded] | None = None


async def load_contexts(conn: psycopg.AsyncConnection, wanted: list[ContextWanted]) -> list[ContextRows]:
    """Every run's context reads in one pipeline: a claim pass that starts 2,000 runs costs
    one round trip and one pooled connection, not 4,000 and 2,000 waits for the pool. Only
    each run's own user's rows are read."""
    queued = []
    async with conn.pipeline():
        for w in wanted:
            user = {"user_id": w.user_id}
            queued.append(
                (
                    await conn.execute(Q.agent_sessions_load, {**user, "ids": w.session_ids})
                    if w.session_ids
                    else None,
                    await conn.execute(Q.agent_memory_load, user),
                    await conn.execute(Q.agent_recent_messages, {**user, "limit": w.recent_limit})
                    if w.recent_limit
                    else None,
                    await conn.execute(Q.agent_policies_get, user),
                    await conn.execute(Q.agent_dead_events, {**user, "limit": w.dead_limit}),
                    await conn.execute(Q.agent_approvals_load, {**user, "ids": w.request_ids})
                    if w.request_ids
                    else None,
                )
            )
    out = []
    for w, (sessions, memory, recent, policies, dead, approvals) in zip(wanted, queued, strict=True):
        rows = ContextRows()
        if sessions is not None:
            rows.sessions = {
                r["id"]: SessionRow(
                    r["id"],
                    w.user_id,
                    r["state"],
                    list(r["messages"]),
                    0,
                    r["blocks"],
                    r["consecutive_blocks"],
                    r["pending"],
                )
                for r in await sessions.fetchall()
            }
        rows.memory = {r["path"]: r["content"] for r in await memory.fetchall()}
        if recent is not None:
            rows.recent = [(r["body"], r["queued"]) for r in reversed(await recent.fetchall())]
        row = await policies.fetchone()
        rows.event_policies = row["event_policies"] if row else ""
        rows.dead_events = [dict(r) for r in await dead.fetchall()]
        if approvals is not None:
            rows.approvals = [
                ApprovalLoaded(
                    r["request_id"], r["session_id"], r["tool"], r["tool_use_id"], r["args_hash"], r["answer"]
                )
                for r in await approvals.fetchall()
            ]
        out.append(rows)
    return out


def session_params(row: SessionRow) -> dict:
    """``agent_session_upsert``'s parameters (for tests that store sessions on a plain connection)."""
    return {
        "id": row.id,
        "user_id": row.user_id,
        "state": row.state,
        "messages": Jsonb(row.messages),
        "size_bytes": row.size_bytes,
        "blocks": row.blocks,
        "consecutive_blocks": row.consecutive_blocks,
        "pending": Jsonb(row.pending) if row.pending is not None else None,
    }


async def save_session(conn: psycopg.AsyncConnection, row: SessionRow) -> None:
    """Store a run's session (in the finish transaction); never another user's row."""
    await conn.execute(Q.agent_session_upsert, session_params(row))


@dataclass(frozen=True, slots=True)
class MessageTag:
    """A message's session (a reply to its delivery resumes it) and deadline (an approval question)."""

    run_id: int
    n: int  # its position among the run's messages, from 1
    session_id: str | None
    deadline: datetime | None


async def tag_messages(conn: psycopg.AsyncConnection, tags: list[MessageTag]) -> None:
    """In the finish, after finish_runs: every tag of the group in one statement."""
    if not tags:
        return
    await conn.execute(
        Q.outbox_tag_messages,
        {
            "run_id": [t.run_id for t in tags],
            "n": [t.n for t in tags],
            "session_id": [t.session_id for t in tags],
            "deadline": [t.deadline for t in tags],
        },
    )


@dataclass(frozen=True, slots=True)
class Policies:
    user_id: str
    event_policies: str
    updated_at: datetime | None


def get_policies(conn: psycopg.Connection, user_id: str) -> Policies | None:
    row = conn.execute(Q.agent_policies_get, {"user_id": user_id}).fetchone()
    return Policies(row["user_id"], row["event_policies"], row["updated_at"]) if row else None


def set_policies(conn: psycopg.Connection, user_id: str, event_policies: str) -> Policies:
    """Replace the user's overrides ('' clears them)."""
    row = conn.execute(Q.agent_policies_set, {"user_id": user_id, "event_policies": event_policies}).fetchone()
    assert row is not None
    return Policies(row["user_id"], row["event_policies"], row["updated_at"])


@dataclass(frozen=True, slots=True)
class Refund:
    id: int
    user_id: str
    order_id: str
    amount: Decimal


async def record_refund(
    conn: psycopg.AsyncConnection,
    idempotency_key: str,
    user_id: str,
    order_id: str,
    amount: Decimal,
    reason: str | None,
) -> Refund | None:
    """One refund per idempotency key. None: the key was used before (see :func:`get_refund`)."""
    cur = await conn.execute(
        Q.refund_record,
        {
            "idempotency_key": idempotency_key,
            "user_id": user_id,
            "order_id": order_id,
            "amount": amount,
            "reason": reason,
        },
    )
    row = await cur.fetchone()
    return Refund(row["id"], row["user_id"], row["order_id"], row["amount"]) if row else None


async def get_refund(conn: psycopg.AsyncConnection, idempotency_key: str) -> Refund | None:
    row = await (await conn.execute(Q.refund_get, {"idempotency_key": idempotency_key})).fetchone()
    return Refund(row["id"], row["user_id"], row["order_id"], row["amount"]) if row else None
