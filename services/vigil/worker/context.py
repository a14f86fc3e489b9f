"""What a run starts from, read from the ledger: session, memory, past messages, answers."""

from __future__ import annotations


import psycopg

from vigil.agent.base import RunContext, SavedSession
from vigil.ledger.queries import Q

RECENT_MESSAGES = 20  # enough for the agent not to repeat itself, small enough for the prompt


async def load_context(conn: psycopg.AsyncConnection, ctx: RunContext) -> None:
    """Fill ``ctx`` in place. Only the user's own rows are ever read."""
    user = {"user_id": ctx.user_id}
    session_id = next((e.session_id for e in ctx.events if e.session_id), None)
    if session_id:
        row = await (await conn.execute(Q.load_session, {**user, "id": session_id})).fetchone()
        if row is not None:
            ctx.session = SavedSession(row["id"], row["state"], list(row["messages"]), row["blocks"])
    rows = await (await conn.execute(Q.load_memory, user)).fetchall()
    ctx.memory = {row["path"]: row["content"] for row in rows}
    rows = await (await conn.execute(Q.recent_messages, {**user, "limit": RECENT_MESSAGES})).fetchall()
    ctx.recent_messages = [row["body"] for row in reversed(rows)]
    request_ids = []
    for event in ctx.events:
        if event.source == "approval":
            payload = event.payload_json()
            if isinstance(payload, dict) and payload.get("request_id"):
                request_ids.append(str(payload["request_id"]))
    if request_ids:
        rows = await (await conn.execute(Q.approval_answers, {**user, "ids": request_ids})).fetchall()
        ctx.approvals = {row["request_id"]: row["answer"] for row in rows}


