"""The benchmark's named statements (``bench/queries.sql``), loaded like the ledger's."""

from __future__ import annotations

from pathlib import Path

from vigil.ledger.queries import Queries, parse

B = Queries(
    parse(
        text=(Path(__file__).resolve().parent / "queries.sql").read_text(encoding="utf-8"), origin="bench/queries.sql"
    )
)
