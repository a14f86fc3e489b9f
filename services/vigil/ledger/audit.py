"""The operators' audit trail (``queries/audit.sql``): who changed what, and when."""

from __future__ import annotations

import psycopg
from psycopg.types.json import Jsonb

from vigil.ledger.queries import Q


def record(conn: psycopg.Connection, actor: str, action: str, detail: dict) -> None:
    conn.execute(Q.audit_insert, {"actor": actor, "action": action, "detail": Jsonb(detail)})


async def record_async(conn: psycopg.AsyncConnection, actor: str, action: str, detail: dict) -> None:
    await conn.execute(Q.audit_insert, {"actor": actor, "action": action, "detail": Jsonb(detail)})
