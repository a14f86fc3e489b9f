"""Console sessions: typed functions over ``queries/sessions.sql`` (migration 0028).

A console login makes a session: the browser's cookie holds a random id, stored here only as
its sha256 (a reader of the ledger cannot sign in with it), bound to the API token that
logged in and carrying the session's random CSRF value. The console reads a session on every
page (cached for ``VIGIL_CONSOLE_AUTH_CACHE_S``); logout and expiry end it here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class Session:
    """A session and its token, as the console's authentication needs them."""

    token_id: str
    name: str
    csrf: str
    expires_at: datetime
    ended_at: datetime | None
    revoked_at: datetime | None
    token_expires_at: datetime | None
    scopes: list[str] | None
    users: list[str] | None

    def live(self, now: datetime) -> bool:
        """Not ended and not expired at ``now`` (the token is judged on its own)."""
        return self.ended_at is None and now < self.expires_at


def create(
    conn: psycopg.Connection[DictRow],
    *,
    id_hash: str,
    token_id: str,
    csrf: str,
    now: datetime,
    expires_at: datetime,
) -> None:
    """Store a new session, after sweeping the sessions already past their end (one
    transaction: a crash leaves neither, and the sweep is bounded by the expiry index)."""
    with conn.transaction():
        conn.execute(Q.session_purge, {"now": now})
        conn.execute(
            Q.session_create,
            {"id_hash": id_hash, "token_id": token_id, "csrf": csrf, "now": now, "expires_at": expires_at},
        )


def by_hash(conn: psycopg.Connection[DictRow], id_hash: str) -> Session | None:
    row = conn.execute(Q.session_by_hash, {"id_hash": id_hash}).fetchone()
    return None if row is None else Session(**row)


def end(conn: psycopg.Connection[DictRow], id_hash: str, now: datetime) -> bool:
    """Logout. False: unknown, or ended already."""
    return conn.execute(Q.session_end, {"id_hash": id_hash, "now": now}).fetchone() is not None


def live_hashes(conn: psycopg.Connection[DictRow], now: datetime) -> frozenset[str]:
    """Every live session's hash (the console's miss guard)."""
    return frozenset(row["id_hash"] for row in conn.execute(Q.session_hashes, {"now": now}).fetchall())
