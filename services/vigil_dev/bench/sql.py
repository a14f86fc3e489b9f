"""The benchmark's named statements (``bench/queries.sql``), loaded like the ledger's."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from itertools import count
from pathlib import Path

import psycopg

from vigil.ledger.queries import Queries, parse

B = Queries(
    parse(
        text=(Path(__file__).resolve().parent / "queries.sql").read_text(encoding="utf-8"), origin="bench/queries.sql"
    )
)

_slots = count()


@contextlib.contextmanager
def wal_kept(dsns: Iterable[str]) -> Iterator[None]:
    """Within the block, every server of ``dsns`` keeps the WAL written from its start
    (query ``keep_wal``), so that pg_walinspect can read it back at the end. A server or a
    role that cannot (no replication slots, no privilege) is said so on stderr; the reads then
    may fail and say why."""
    with contextlib.ExitStack() as stack:
        for dsn in dsns:
            try:
                conn = stack.enter_context(psycopg.connect(dsn, autocommit=True))
                conn.execute(B.keep_wal, {"name": f"vigil_bench_{os.getpid()}_{next(_slots)}"})
            except psycopg.Error as exc:
                print(f"  WAL not kept for the read-back: {exc.diag.message_primary or exc}", file=sys.stderr)
        yield
