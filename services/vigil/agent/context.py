"""The ledger side of a Claude run: what it starts from, and how its sessions are stored.

For the worker: :func:`load_context_parts` fills a claimed run's :class:`RunContext`
before ``agent.run``; :func:`session_rows` gives the parameters of ``Q.agent_session_upsert``
for every session a :class:`RunResult` saved, to execute in the fenced finish.
Only the user's own rows are ever read or written.
"""

from __future__ import annotations

import psycopg
from psycopg.types.json import Jsonb

from vigil.agent.base import ApprovalRequest, RunContext, RunResult, SavedSession
from vigil.agent.sessions import request_id_of, size_bytes
from vigil.ledger.queries import Q

# Dead events told to the agent at one run: enough to say what failed, bounded for the prompt.
DEAD_EVENTS_SHOWN = 20


async def load_context_parts(conn: psycopg.AsyncConnection, ctx: RunContext, recent_limit: int) -> None:
    """Fill ``ctx`` in place: every session its events name, memory, past messages (the newest
    ``recent_limit``: delivered ones, and those the outbox still holds back for the pacing gap),
    the user's events that died since their last run that did not fail, the user's own event
    policies, and the approval requests its approval events name (with the approved argument
    hash)."""
    user = {"user_id": ctx.user_id}
    session_ids = list(dict.fromkeys(e.session_id for e in ctx.events if e.session_id))
    if session_ids:
        rows = await (await conn.execute(Q.agent_sessions_load, {**user, "ids": session_ids})).fetchall()
        found = {
            row["id"]: SavedSession(
                row["id"], row["state"], list(row["messages"]), row["blocks"], row["consecutive_blocks"], row["pending"]
            )
            for row in rows
        }
        ctx.sessions = {sid: found[sid] for sid in session_ids if sid in found}
        ctx.session = next(iter(ctx.sessions.values()), None)
    rows = await (await conn.execute(Q.agent_memory_load, user)).fetchall()
    ctx.memory = {row["path"]: row["content"] for row in rows}
    if recent_limit:
        rows = await (await conn.execute(Q.agent_recent_messages, {**user, "limit": recent_limit})).fetchall()
        ctx.recent_messages = [row["body"] for row in reversed(rows) if not row["queued"]]
        ctx.queued_messages = [row["body"] for row in reversed(rows) if row["queued"]]
    row = await (await conn.execute(Q.agent_policies_get, user)).fetchone()
    ctx.event_policies = row["event_policies"] if row else ""
    rows = await (await conn.execute(Q.agent_dead_events, {**user, "limit": DEAD_EVENTS_SHOWN})).fetchall()
    ctx.dead_events = [dict(row) for row in rows]
    request_ids = list(dict.fromkeys(r for e in ctx.events if e.source == "approval" and (r := request_id_of(e))))
    if request_ids:
        rows = await (await conn.execute(Q.agent_approvals_load, {**user, "ids": request_ids})).fetchall()
        ctx.approval_requests = {
            row["request_id"]: ApprovalRequest(
                row["request_id"], row["session_id"], row["tool"], row["tool_use_id"], row["args_hash"], row["answer"]
            )
            for row in rows
        }
        ctx.approvals = {r.request_id: r.answer for r in ctx.approval_requests.values() if r.answer}


def session_rows(user_id: str, result: RunResult) -> list[dict]:
    """``Q.agent_session_upsert`` parameters for each session the run saved."""
    saves = ([result.session] if result.session else []) + list(result.other_sessions)
    return [
        {
            "id": s.id,
            "user_id": user_id,
            "state": s.state,
            "messages": Jsonb(s.messages),
            "size_bytes": size_bytes(s.messages),
            "blocks": s.blocks,
            "consecutive_blocks": s.consecutive_blocks,
            "pending": Jsonb(s.pending) if s.pending is not None else None,
        }
        for s in saves
    ]


async def write_sessions(conn: psycopg.AsyncConnection, user_id: str, result: RunResult) -> None:
    """Store the run's sessions (call inside the finish transaction)."""
    for params in session_rows(user_id, result):
        await conn.execute(Q.agent_session_upsert, params)


__all__ = ["load_context_parts", "session_rows", "write_sessions"]
