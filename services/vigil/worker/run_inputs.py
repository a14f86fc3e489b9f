"""What a run starts from, read from the ledger: session, memory, past messages, answers."""

from __future__ import annotations

import psycopg
from psycopg.rows import DictRow

from vigil.agent.base import RunContext
from vigil.agent.run_ledger import load_context_parts, load_contexts

# For an agent that does not say how many past messages it wants (``agent.recent_messages``):
# enough for it not to repeat itself, small enough for the prompt.
RECENT_MESSAGES = 20


async def load_context(
    conn: psycopg.AsyncConnection[DictRow], ctx: RunContext, recent_limit: int = RECENT_MESSAGES, journal: bool = False
) -> None:
    """Fill ``ctx`` in place (``journal``: with the user's live run journal). Only the user's
    own rows are ever read."""
    await load_context_parts(conn, ctx, recent_limit, journal)


async def load_many(
    conn: psycopg.AsyncConnection[DictRow],
    ctxs: list[RunContext],
    recent_limit: int = RECENT_MESSAGES,
    journal: bool = False,
) -> None:
    """Fill every ``ctx`` of a claim pass in place, in one pipeline (one round trip)."""
    await load_contexts(conn, ctxs, recent_limit, journal)
