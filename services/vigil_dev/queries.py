"""The tooling's own read-only SQL (``queries/*.sql``): what the demo and the chaos run check.

These look-ups are not part of the product, so they stay out of the ledger package's
queries; they use the same ``-- name:`` format and parser.
"""

from __future__ import annotations

from pathlib import Path

from vigil.ledger.queries import Queries, parse

QUERIES_DIR = Path(__file__).resolve().parent / "queries"

Q = Queries()
for _path in sorted(QUERIES_DIR.glob("*.sql")):
    Q.update(parse(text=_path.read_text(encoding="utf-8"), origin=_path.name))
