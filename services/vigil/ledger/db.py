"""Connections to the ledger."""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row

# A statement that waits this long on a lock is a bug or an incident, not normal contention;
# failing it surfaces the problem instead of piling up connections.
STATEMENT_TIMEOUT_MS = 30_000


def connect(dsn: str, *, autocommit: bool = False, rows=dict_row) -> psycopg.Connection:
    return psycopg.connect(
        dsn,
        autocommit=autocommit,
        row_factory=rows,
        options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
    )
