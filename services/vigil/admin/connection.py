"""The ledger connection of a CLI command (``vigil timers``, ``vigil tokens``, ``vigil dead``...).

Apart from :mod:`vigil.ledger.db` because it reads the settings through :mod:`vigil.service`,
which sits above the ledger (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.db import connect
from vigil.service import load_or_exit
from vigil.settings import CommonSettings


@contextmanager
def cli_connection(*, autocommit: bool = True) -> Iterator[psycopg.Connection[DictRow]]:
    """A connection to ``VIGIL_DATABASE_URL`` for one command, closed at the end.

    Without ``autocommit`` the block is one transaction, committed when it exits normally. A
    ledger that does not answer raises psycopg.OperationalError, which the CLI turns into one
    line and exit 3 (vigil.service.VigilGroup).
    """
    with connect(load_or_exit(CommonSettings).dsn, autocommit=autocommit) as conn:
        yield conn
