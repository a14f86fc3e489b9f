"""Trace context stored with events (``queries/tracing.sql``), read only when traces are on."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class EventTrace:
    id: int
    headers: dict[str, str]  # the stored trace context: traceparent and tracestate, when present
    claimed_at: datetime | None


async def event_trace_context(conn: psycopg.AsyncConnection[DictRow], ids: list[int]) -> list[EventTrace]:
    """A run's events' trace context (written by the worker's record span) and claim time, by id."""
    rows = await (await conn.execute(Q.event_trace_context, {"ids": ids})).fetchall()
    return [
        EventTrace(
            row["id"],
            {k: row[k] for k in ("traceparent", "tracestate") if row[k] is not None},
            row["claimed_at"],
        )
        for row in rows
    ]
