"""The Python state enums and the schema's CHECK constraints say the same thing."""

from __future__ import annotations

import re

import psycopg

from vigil.ledger.states import CHECKED


def test_enums_match_check_constraints(ledger):
    with psycopg.connect(ledger) as conn:
        rows = dict(
            conn.execute(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = ANY(%s)",
                (list(CHECKED),),
            ).fetchall()
        )
    assert set(rows) == set(CHECKED), f"constraints missing: {set(CHECKED) - set(rows)}"
    for name, enum in CHECKED.items():
        allowed = set(re.findall(r"'([^']+)'::text", rows[name]))
        assert allowed == {member.value for member in enum}, name
