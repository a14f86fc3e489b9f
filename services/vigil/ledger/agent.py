"""The Claude agent's reads and writes (``queries/agent.sql``): what a run starts from
(sessions, memory, past messages, policies, dead events, the approvals it resumes), the
saved sessions, the messages' tags, per-user policies, and the demo refund tool's record."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from vigil.ledger import journal as ledger_journal
from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class ContextWanted:
    """What to read for one run."""

    user_id: str
    session_ids: list[str]  # the sessions its events name, in order
    request_ids: list[str]  # the approval requests its approval events name
    recent_limit: int  # past messages to read (0: none)
    dead_limit: int
    journal: bool = False  # the user's live run journal too (vigil.ledger.journal)


@dataclass(frozen=True, slots=True)
class SessionRow:
    """A ``sessions`` row, as saved by a run's finish and read by the next run."""

    id: str
    user_id: str
    state: str
    messages: list[dict[str, Any]]
    size_bytes: int
    blocks: int
    consecutive_blocks: int
    pending: dict[str, Any] | None
    messages_json: str | None = None  # the messages already encoded (what the finish stores), else None


@dataclass(frozen=True, slots=True)
class ApprovalLoaded:
    request_id: str
    session_id: str
    tool: str
    tool_use_id: str | None
    args_hash: str
    answer: str | None


@dataclass(slots=True)
class ContextRows:
    """What :func:`load_contexts` read for one run (``None``: not asked for)."""

    sessions: dict[str, SessionRow] | None = None
    memory: dict[str, str] = field(default_factory=dict)
    recent: list[tuple[str, bool]] | None = None  # (body, still queued), oldest first
    event_policies: str = ""
    dead_events: list[dict[str, Any]] = field(default_factory=list)
    approvals: list[ApprovalLoaded] | None = None
    journal: list[ledger_journal.Live] | None = None  # the user's live journals, oldest lead first


async def memory_of(conn: psycopg.AsyncConnection[DictRow], user_id: str) -> dict[str, str]:
    """One user's memory files, path -> content (a memory review starts from them)."""
    cur = await conn.execute(Q.agent_memory_load_many, {"user_ids": [user_id]})
    return {r["path"]: r["content"] for r in await cur.fetchall()}


async def load_contexts(conn: psycopg.AsyncConnection[DictRow], wanted: list[ContextWanted]) -> list[ContextRows]:
    """Every run's context reads for a whole claim pass: six statements whatever the runs
    (seven with the live run journals; each reads all the pass's users at once), in one
    pipeline, so a pass that starts 2,000 runs costs one round trip and one pooled connection.
    Only each run's own user's rows are read: sessions and approvals by (user, id) pairs."""
    if not wanted:
        return []
    users = [w.user_id for w in wanted]
    recent = [w for w in wanted if w.recent_limit]
    session_pairs = [(w.user_id, sid) for w in wanted for sid in w.session_ids]
    approval_pairs = [(w.user_id, rid) for w in wanted for rid in w.request_ids]
    async with conn.pipeline():
        sessions = await _pairs(conn, Q.agent_sessions_load_many, session_pairs)
        memory = await conn.execute(Q.agent_memory_load_many, {"user_ids": users})
        past = (
            await conn.execute(
                Q.agent_recent_messages_many,
                {"user_ids": [w.user_id for w in recent], "limits": [w.recent_limit for w in recent]},
            )
            if recent
            else None
        )
        policies = await conn.execute(Q.agent_policies_many, {"user_ids": users})
        dead = await conn.execute(
            Q.agent_dead_events_many, {"user_ids": users, "limit": max(w.dead_limit for w in wanted)}
        )
        approvals = await _pairs(conn, Q.agent_approvals_load_many, approval_pairs)
        journal_users = [w.user_id for w in wanted if w.journal]
        journals = await ledger_journal.live_many_cursor(conn, journal_users) if journal_users else None
    out = {w.user_id: ContextRows() for w in wanted}
    for w in wanted:
        if w.session_ids:
            out[w.user_id].sessions = {}
        if w.recent_limit:
            out[w.user_id].recent = []
        if w.request_ids:
            out[w.user_id].approvals = []
    for r in await sessions.fetchall() if sessions else []:
        sessions_of = out[r["user_id"]].sessions
        assert sessions_of is not None  # a dict for every user whose sessions were asked for (above)
        sessions_of[r["id"]] = SessionRow(
            r["id"],
            r["user_id"],
            r["state"],
            list(r["messages"]),
            0,
            r["blocks"],
            r["consecutive_blocks"],
            r["pending"],
        )
    for r in await memory.fetchall():
        out[r["user_id"]].memory[r["path"]] = r["content"]
    for r in await past.fetchall() if past else []:
        recent_of = out[r["user_id"]].recent
        assert recent_of is not None  # a list for every user whose recent events were asked for (above)
        recent_of.append((r["body"], r["queued"]))  # newest first, reversed below
    for rows in out.values():
        if rows.recent:
            rows.recent.reverse()
    for r in await policies.fetchall():
        out[r["user_id"]].event_policies = r["event_policies"]
    for r in await dead.fetchall():
        row = dict(r)
        out[row.pop("user_id")].dead_events.append(row)
    for r in await approvals.fetchall() if approvals else []:
        approvals_of = out[r["user_id"]].approvals
        assert approvals_of is not None  # a list for every user whose approvals were asked for (above)
        approvals_of.append(
            ApprovalLoaded(r["request_id"], r["session_id"], r["tool"], r["tool_use_id"], r["args_hash"], r["answer"])
        )
    if journals is not None:
        for user_id, lives in (await ledger_journal.live_from(journals)).items():
            out[user_id].journal = lives
    return [out[w.user_id] for w in wanted]


async def has_session(conn: psycopg.AsyncConnection[DictRow], *, user_id: str, session_id: str) -> bool:
    """Whether ``user_id`` has a saved session ``session_id`` (another user's is not theirs)."""
    cursor = await conn.execute(Q.agent_session_of_user, {"user_id": user_id, "session_id": session_id})
    row = await cursor.fetchone()
    return bool(row and row["found"])


async def _pairs(
    conn: psycopg.AsyncConnection[DictRow], query: str, pairs: list[tuple[str, str]]
) -> psycopg.AsyncCursor[DictRow] | None:
    """A (user, id) pairs statement, or None when there are no pairs."""
    if not pairs:
        return None
    return await conn.execute(query, {"user_ids": [u for u, _ in pairs], "ids": [i for _, i in pairs]})


async def save_sessions(conn: psycopg.AsyncConnection[DictRow], rows: list[SessionRow]) -> None:
    """Store a finish group's sessions in one statement (in the finish transaction); never
    another user's row. A session saved twice in the group keeps its last save."""
    last = {row.id: row for row in rows}
    if not last:
        return
    rows = list(last.values())
    await conn.execute(
        Q.agent_sessions_save_many,
        {
            "ids": [r.id for r in rows],
            "user_ids": [r.user_id for r in rows],
            "states": [r.state for r in rows],
            # Already-encoded conversations joined into one JSON array, not re-encoded.
            "messages": "["
            + ",".join(r.messages_json if r.messages_json is not None else json.dumps(r.messages) for r in rows)
            + "]",
            "sizes": [r.size_bytes for r in rows],
            "blocks": [r.blocks for r in rows],
            "consecutive": [r.consecutive_blocks for r in rows],
            "pending": json.dumps([r.pending for r in rows]),
        },
    )


@dataclass(frozen=True, slots=True)
class MessageTag:
    """A message's session (a reply to its delivery resumes it), deadline and answer actions
    (an approval question)."""

    run_id: int
    n: int  # its position among the run's messages, from 1
    session_id: str | None
    deadline: datetime | None
    actions: tuple[dict[str, Any], ...] = ()


async def tag_messages(conn: psycopg.AsyncConnection[DictRow], tags: list[MessageTag]) -> None:
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
            "actions": [Jsonb(list(t.actions)) if t.actions else None for t in tags],
        },
    )


@dataclass(frozen=True, slots=True)
class Policies:
    user_id: str
    event_policies: str
    updated_at: datetime | None


def get_policies(conn: psycopg.Connection[DictRow], user_id: str) -> Policies | None:
    row = conn.execute(Q.agent_policies_get, {"user_id": user_id}).fetchone()
    return Policies(row["user_id"], row["event_policies"], row["updated_at"]) if row else None


def set_policies(conn: psycopg.Connection[DictRow], *, user_id: str, event_policies: str) -> Policies:
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
    conn: psycopg.AsyncConnection[DictRow],
    *,
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


async def get_refund(conn: psycopg.AsyncConnection[DictRow], idempotency_key: str) -> Refund | None:
    row = await (await conn.execute(Q.refund_get, {"idempotency_key": idempotency_key})).fetchone()
    return Refund(row["id"], row["user_id"], row["order_id"], row["amount"]) if row else None
