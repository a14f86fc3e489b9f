"""Connections to the ledger."""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row

# A statement that waits this long on a lock is a bug or an incident, not normal contention;
# failing it surfaces the problem instead of piling up connections.
STATEMENT_TIMEOUT_MS = 30_000


# Every session vigil opens: the statement timeout, and synchronous commit whatever the
# server's default. A commit vigil acts on (an offset stored, a 2xx answered, a delivery sent)
# must survive the server's crash: with synchronous_commit=off, the commits of the last few
# hundred milliseconds vanish with the process, after the worker stored the Kafka offsets past
# them. (A server may still be set to off for other clients; the session setting wins.)
SESSION_OPTIONS = f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c synchronous_commit=on"


def connection_kwargs(*, autocommit: bool = False, rows=dict_row) -> dict:
    """What every ledger connection (single or pooled) is opened with."""
    return {"autocommit": autocommit, "row_factory": rows, "options": SESSION_OPTIONS}


def connect(dsn: str, *, autocommit: bool = False, rows=dict_row) -> psycopg.Connection:
    return psycopg.connect(dsn, **connection_kwargs(autocommit=autocommit, rows=rows))
