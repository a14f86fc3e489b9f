"""What a run starts from, read from the ledger: session, memory, past messages, answers."""

from __future__ import annotations

import psycopg

from vigil.agent.base import RunContext
from vigil.agent.context import load_context_parts, load_contexts

RECENT_MESSAGES = 20  # enough for the agent not to repeat itself, small enough for the prompt


async def load_context(conn: psycopg.AsyncConnection, ctx: RunContext) -> None:
    """Fill ``ctx`` in place. Only the user's own rows are ever read."""
    await load_context_parts(conn, ctx, RECENT_MESSAGES)


async def load_many(conn: psycopg.AsyncConnection, ctxs: list[RunContext]) -> None:
    """Fill every ``ctx`` of a claim pass in place, in one pipeline (one round trip)."""
    await load_contexts(conn, ctxs, RECENT_MESSAGES)
