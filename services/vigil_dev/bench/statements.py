"""``--statements``: which of the ledger's statements a latency round spent PostgreSQL on.

The bench's own server loads ``pg_stat_statements`` at start when asked (it costs a little
on every statement, so only then); each latency round resets it before the load and prints
its costliest statements after, by the names of ``services/vigil/ledger/queries/*.sql``.
Execution time includes waiting for a core or a lock: on a saturated machine it says where
PostgreSQL was busy or queued, not its CPU alone (``cost_pg_cpu_*`` is that).
"""

from __future__ import annotations

import re
import sys

import psycopg
from psycopg.rows import dict_row

from vigil.ledger.db import statement_names
from vigil_dev.bench.sql import B

TOP = 8
# psycopg sends ``%(name)s`` as ``$n``, in the comments too: both spellings compare as one.
PLACEHOLDER = re.compile(r"%\(\w+\)[sb]|\$\d+")


def reset(dsn: str) -> bool:
    """Start counting; False (with a note) when the server did not load the library."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(B.statements_extension)
            conn.execute(B.statements_reset)
        return True
    except psycopg.Error as exc:
        print(f"  statements: not available ({exc.diag.message_primary or exc})", file=sys.stderr, flush=True)
        return False


def report(dsn: str, n: int = TOP) -> None:
    """Print the ``n`` costliest statements since :func:`reset`, named after their query."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        rows = conn.execute(B.statements_top, {"n": n}).fetchall()
    names = _names()
    for row in rows:
        print(
            f"    {_name(row['query'], names)}: {row['calls']} calls, {row['total_ms']:.0f} ms,"
            f" {row['mean_ms']:.2f} ms each, {row['rows']} rows",
            file=sys.stderr,
            flush=True,
        )


def _names() -> dict[str, str]:
    """A query's first line (its description, which PostgreSQL sees too) -> its name: the
    ledger's, and the bench's own prefixed ``bench:``."""
    ledger = {_first_line(sql): name for sql, name in statement_names().items()}
    return {**ledger, **{_first_line(sql): f"bench:{name}" for name, sql in B.items()}}


def _first_line(sql: str) -> str:
    """The first line with every placeholder alike: psycopg sends ``%(name)s`` as ``$n``,
    in the comments too."""
    line = sql.strip().splitlines()[0] if sql.strip() else ""
    return PLACEHOLDER.sub("?", line)


def _name(query: str, names: dict[str, str]) -> str:
    return names.get(_first_line(query)) or " ".join(query.split())[:70]
