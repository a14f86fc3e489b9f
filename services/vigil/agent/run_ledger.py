"""The ledger side of a Claude run: what it starts from, and how its sessions are stored.

For the worker: :func:`load_context_parts` fills a claimed run's :class:`RunContext`
before ``agent.run`` (:func:`load_contexts` fills a whole claim pass's in one pipeline);
:func:`session_rows` gives the ``sessions`` rows (:func:`vigil.ledger.agent.save_sessions`) of every session
a :class:`RunResult` saved, to execute in the fenced finish.
Only the user's own rows are ever read or written.
"""

from __future__ import annotations

import psycopg
from psycopg.rows import DictRow

from vigil.agent.base import ApprovalRequest, RunContext, RunResult, SavedSession
from vigil.agent.sessions import encode_messages, request_id_of
from vigil.ledger import agent as ledger_agent

# Dead events told to the agent at one run: enough to say what failed, bounded for the prompt.
DEAD_EVENTS_SHOWN = 20


async def load_context_parts(
    conn: psycopg.AsyncConnection[DictRow], ctx: RunContext, recent_limit: int, journal: bool = False
) -> None:
    """Fill ``ctx`` in place: every session its events name, memory, past messages (the newest
    ``recent_limit``: delivered ones, and those the outbox still holds back for the pacing gap),
    the user's events that died since their last run that did not fail, the user's own event
    policies, and the approval requests its approval events name (with the approved argument
    hash)."""
    await load_contexts(conn, [ctx], recent_limit, journal)


async def load_contexts(
    conn: psycopg.AsyncConnection[DictRow], ctxs: list[RunContext], recent_limit: int, journal: bool = False
) -> None:
    """:func:`load_context_parts` for many runs at once, in one pipeline
    (:func:`vigil.ledger.agent.load_contexts`). ``journal``: each user's live run journal
    too, left in ``ctx.found`` for the worker to open the run's journal against."""
    wanted = [
        ledger_agent.ContextWanted(
            user_id=ctx.user_id,
            session_ids=list(dict.fromkeys(e.session_id for e in ctx.events if e.session_id)),
            request_ids=list(
                dict.fromkeys(r for e in ctx.events if e.source == "approval" and (r := request_id_of(e)))
            ),
            recent_limit=recent_limit,
            dead_limit=DEAD_EVENTS_SHOWN,
            journal=journal,
        )
        for ctx in ctxs
    ]
    for ctx, want, rows in zip(ctxs, wanted, await ledger_agent.load_contexts(conn, wanted), strict=True):
        _fill(ctx, want, rows)


def _fill(ctx: RunContext, want: ledger_agent.ContextWanted, rows: ledger_agent.ContextRows) -> None:
    if rows.sessions is not None:
        found = rows.sessions
        ctx.sessions = {
            sid: SavedSession(s.id, s.state, s.messages, s.blocks, s.consecutive_blocks, s.pending)
            for sid in want.session_ids
            if (s := found.get(sid)) is not None
        }
        ctx.session = next(iter(ctx.sessions.values()), None)
    ctx.memory = rows.memory
    ctx.found = rows.journal
    if rows.recent is not None:
        ctx.recent_messages = [body for body, queued in rows.recent if not queued]
        ctx.queued_messages = [body for body, queued in rows.recent if queued]
    ctx.event_policies = rows.event_policies
    ctx.dead_events = rows.dead_events
    if rows.approvals is not None:
        ctx.approval_requests = {
            r.request_id: ApprovalRequest(r.request_id, r.session_id, r.tool, r.tool_use_id, r.args_hash, r.answer)
            for r in rows.approvals
        }
        ctx.approvals = {r.request_id: r.answer for r in ctx.approval_requests.values() if r.answer}


def session_rows(user_id: str, result: RunResult) -> list[ledger_agent.SessionRow]:
    """The ``sessions`` rows of every session the run saved (stored by the finish:
    :func:`vigil.ledger.agent.save_sessions`), each conversation encoded once."""
    saves = ([result.session] if result.session else []) + list(result.other_sessions)
    rows = []
    for s in saves:
        encoded = s.encoded if s.encoded is not None else encode_messages(s.messages)
        rows.append(
            ledger_agent.SessionRow(
                id=s.id,
                user_id=user_id,
                state=s.state,
                messages=s.messages,
                size_bytes=len(encoded.encode()),
                blocks=s.blocks,
                consecutive_blocks=s.consecutive_blocks,
                pending=s.pending,
                messages_json=encoded,
            )
        )
    return rows


__all__ = ["load_context_parts", "load_contexts", "session_rows"]
