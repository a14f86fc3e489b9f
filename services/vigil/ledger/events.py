"""Operator writes on events (``queries/events.sql``), shared by `vigil dead retry` and the console."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.types.json import Jsonb

from vigil.ledger.queries import Q


@dataclass(frozen=True)
class Retried:
    retried: list[int]  # sent back to pending
    missing: list[int]  # asked for but not dead (unknown, or someone retried them already): left alone


def retry_dead_events(conn: psycopg.Connection, ids: list[int], actor: str) -> Retried:
    """Send dead events back to pending with their attempts reset, and audit it, in one transaction.

    The update only moves rows that are still dead, so two operators retrying the same event
    retry it once; the audit row names who asked (``actor``: a login name, or a console
    token's name and id) and what was actually retried. A crash before the commit leaves nothing.
    """
    with conn.transaction():
        rows = conn.execute(Q.dead_retry, {"ids": list(ids), "actor": actor}).fetchall()
        done = [r["id"] for r in rows]
        detail = Jsonb({"requested": list(ids), "retried": done})
        conn.execute(Q.audit_insert, {"actor": actor, "action": "dead.retry", "detail": detail})
    return Retried(retried=sorted(done), missing=sorted(set(ids) - set(done)))
