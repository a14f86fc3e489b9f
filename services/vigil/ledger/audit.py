"""The audit trail of operator actions: the one writer of ``queries/audit.sql``.

Every hand-made change (a dead event or delivery retried, a channel set, a token or hook
created or revoked, a task cancelled) writes one row here in the same transaction as the
change, so the trail never names a change that did not happen, nor misses one that did.
``detail`` is a JSON object; it never holds a secret or a token.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from vigil.ledger.queries import Q


def _params(actor: str, action: str, detail: dict[str, Any]) -> dict[str, Any]:
    return {"actor": actor, "action": action, "detail": Jsonb(detail)}


def record(conn: psycopg.Connection[DictRow], *, actor: str, action: str, detail: dict[str, Any]) -> None:
    """Write one audit row in the caller's transaction (``actor``: a login, or a token's name)."""
    conn.execute(Q.audit_insert, _params(actor, action, detail))


async def record_async(
    conn: psycopg.AsyncConnection[DictRow], *, actor: str, action: str, detail: dict[str, Any]
) -> None:
    """:func:`record` on an async connection."""
    await conn.execute(Q.audit_insert, _params(actor, action, detail))
