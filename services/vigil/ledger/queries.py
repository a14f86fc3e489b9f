"""Named SQL queries, loaded from ``ledger/queries/*.sql``.

Each query sits under a ``-- name: some_name`` header followed by a one-line ``--``
description, one file per table or concern, so every statement the ledger runs can be read
in one place. Services call the typed functions of ``vigil/ledger/<name>.py`` (one module per
``queries/<name>.sql``), not the queries by name; tests/test_one_door.py holds it for the
packages moved so far.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

QUERIES_DIR = Path(__file__).resolve().parent / "queries"
_HEADER = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


class Queries(dict[str, str]):
    """name -> SQL text; attribute access for readability at call sites."""

    def __getattr__(self, name: str) -> str:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r} in {QUERIES_DIR}") from None


def parse(*, text: str, origin: str = "<sql>") -> dict[str, str]:
    parts = _HEADER.split(text)
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        sql = body.strip()
        if not sql:
            raise ValueError(f"{origin}: query {name} is empty")
        found[name] = sql
    return found


@cache
def load() -> Queries:
    queries = Queries()
    for path in sorted(QUERIES_DIR.glob("*.sql")):
        for name, sql in parse(text=path.read_text(encoding="utf-8"), origin=path.name).items():
            if name in queries:
                raise ValueError(f"query {name} defined twice ({path.name})")
            queries[name] = sql
    return queries


Q = load()
