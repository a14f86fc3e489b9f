"""Connections to the ledger: the one place they are built (docs/architecture.md, "One door").

Every connection and pool vigil opens to the ledger comes from a function here, so every
session gets the same settings (:data:`SESSION_OPTIONS`) and the rows the ledger modules
expect (dict rows). Services hold connections and pools and hand them to the typed functions
of the ledger modules; they never run SQL themselves (``tests/test_one_door.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import psycopg
from psycopg.rows import DictRow, RowFactory, dict_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from vigil.ledger.queries import Q

# What callers outside the ledger may name (types for annotations, the pool's timeout error
# to turn into a 503) without importing psycopg_pool themselves.
__all__ = [
    "AsyncPool",
    "Pool",
    "PoolTimeout",
    "STATEMENT_TIMEOUT_MS",
    "async_pool",
    "connect",
    "connect_async",
    "connection_kwargs",
    "is_alive",
    "is_outage",
    "pipelined_transaction",
    "pool",
    "session_options",
    "statement_names",
]

# Pools of the connections connection_kwargs opens: their rows are dicts.
Pool = ConnectionPool[psycopg.Connection[DictRow]]
AsyncPool = AsyncConnectionPool[psycopg.AsyncConnection[DictRow]]

# A statement that waits this long on a lock is a bug or an incident, not normal contention;
# failing it surfaces the problem instead of piling up connections.
STATEMENT_TIMEOUT_MS = 30_000


def session_options(statement_timeout_ms: int = STATEMENT_TIMEOUT_MS, idle_in_transaction_ms: int = 0) -> str:
    """The settings of every session vigil opens: a statement timeout, and synchronous commit.

    Synchronous commit whatever the server's default: a commit vigil acts on (an offset
    stored, a 2xx answered, a delivery sent) must survive the server's crash. With
    synchronous_commit=off the commits of the last few hundred milliseconds vanish with the
    process, after the worker stored the Kafka offsets past them. (A server may still be set
    to off for other clients; the session setting wins.)

    ``idle_in_transaction_ms`` (0: off): the server ends a session idle that long inside a
    transaction, releasing its locks, for a holder whose connection may never close (the
    scheduler's pass, frozen with its batch locked).
    """
    options = f"-c statement_timeout={int(statement_timeout_ms)} -c synchronous_commit=on"
    if idle_in_transaction_ms:
        options += f" -c idle_in_transaction_session_timeout={int(idle_in_transaction_ms)}"
    return options


SESSION_OPTIONS = session_options()


def connection_kwargs(
    *,
    autocommit: bool = False,
    rows: RowFactory[Any] = dict_row,
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
    idle_in_transaction_ms: int = 0,
) -> dict[str, Any]:
    """What every ledger connection (single or pooled) is opened with."""
    options = session_options(statement_timeout_ms, idle_in_transaction_ms)
    return {"autocommit": autocommit, "row_factory": rows, "options": options}


def connect(
    dsn: str,
    *,
    autocommit: bool = False,
    rows: RowFactory[Any] = dict_row,
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
    connect_timeout: int | None = None,
    idle_in_transaction_ms: int = 0,
) -> psycopg.Connection[Any]:
    extra: dict[str, Any] = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
    kwargs = connection_kwargs(
        autocommit=autocommit,
        rows=rows,
        statement_timeout_ms=statement_timeout_ms,
        idle_in_transaction_ms=idle_in_transaction_ms,
    )
    return psycopg.connect(dsn, **kwargs, **extra)


async def connect_async(
    dsn: str, *, autocommit: bool = False, statement_timeout_ms: int = STATEMENT_TIMEOUT_MS
) -> psycopg.AsyncConnection[DictRow]:
    return await psycopg.AsyncConnection.connect(
        dsn, **connection_kwargs(autocommit=autocommit, statement_timeout_ms=statement_timeout_ms)
    )


def pool(
    dsn: str,
    *,
    name: str,
    max_size: int,
    min_size: int = 1,
    timeout: float = 30.0,
    autocommit: bool = False,
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
) -> Pool:
    """A pool (opened by the caller: ``pool.open()``) whose connections are checked on checkout,
    so a connection the server dropped (a restart, a failover) is replaced, not handed out."""
    created = ConnectionPool(
        dsn,
        open=False,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        kwargs=connection_kwargs(autocommit=autocommit, statement_timeout_ms=statement_timeout_ms),
        check=ConnectionPool.check_connection,
        name=name,
    )
    return cast(Pool, created)  # its rows are dicts: connection_kwargs


def async_pool(
    dsn: str,
    *,
    name: str,
    max_size: int,
    min_size: int = 1,
    timeout: float = 30.0,
    autocommit: bool = False,
    check: bool = True,
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS,
) -> AsyncPool:
    """:func:`pool` for asyncio (opened by the caller: ``await pool.open()``).

    ``check=False`` skips the checkout probe: the worker's hot path takes a connection per
    claim and per finish, and a broken one fails its statement and is discarded anyway.
    """
    created = AsyncConnectionPool(
        dsn,
        open=False,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout,
        kwargs=connection_kwargs(autocommit=autocommit, statement_timeout_ms=statement_timeout_ms),
        check=AsyncConnectionPool.check_connection if check else None,
        name=name,
    )
    return cast(AsyncPool, created)  # its rows are dicts: connection_kwargs


def statement_names() -> dict[str, str]:
    """SQL text -> the name of its query in ``queries/*.sql``, for every statement the ledger
    runs (vigil.tracing names a statement's span after its query)."""
    return {sql: name for name, sql in Q.items()}


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` is the ledger lost, not a statement refused: the connection closed or
    terminated under it (a restart, a failover), none to be had from the pool. A statement
    cancelled by its timeout is the statement's own (a run that makes one every time is poison),
    and so is every error PostgreSQL answered about the statement itself."""
    return isinstance(exc, psycopg.OperationalError) and not isinstance(exc, psycopg.errors.QueryCanceled)


def is_alive(conn: psycopg.Connection[Any]) -> None:
    """A round trip that touches no table (a readiness probe); raises psycopg.Error if not."""
    conn.execute("SELECT 1")


@contextlib.asynccontextmanager
async def pipelined_transaction(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[psycopg.AsyncPipeline]:
    """One transaction as one pipeline: BEGIN goes out with the first statements and COMMIT
    with the last (in the pipeline's closing sync), so a transaction costs one round trip per
    result its caller must see before it goes on (each ``fetch*`` flushes) and one to commit.
    psycopg's own transaction block in a pipeline syncs as it opens and again before its
    COMMIT: a claim range took five round trips that way, two this way (``tests/test_worker_claims.py``).
    A statement queued without being fetched is checked only at the commit; a caller that must
    see its outcome before committing calls ``sync()`` on the pipeline yielded. On an
    exception the transaction is rolled back and the exception raised. ``conn`` must be in
    autocommit mode (the pool's), or psycopg would open a transaction of its own first."""
    if not conn.autocommit:
        raise psycopg.ProgrammingError("pipelined_transaction needs an autocommit connection")
    try:
        async with conn.pipeline() as pipeline:
            await conn.execute("BEGIN")
            yield pipeline
            await conn.execute("COMMIT")
    except BaseException:
        if not conn.closed and not conn.broken:
            await conn.rollback()
        raise
