"""One door to PostgreSQL (issue 12, point 1): only ``vigil.ledger`` runs SQL. A module of the
packages below that imports the query loader, or runs a statement of its own text, fails here.

Covered so far: the worker and the agent. The other services move behind the door in their
own change; add their packages to DOOR_KEPT as they do."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vigil

ROOT = Path(vigil.__file__).resolve().parent
DOOR_KEPT = ["worker", "agent"]


def _modules() -> list[Path]:
    return sorted(path for package in DOOR_KEPT for path in (ROOT / package).rglob("*.py"))


def _violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vigil.ledger.queries"):
            found.append(f"line {node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import) and any(a.name.startswith("vigil.ledger.queries") for a in node.names):
            found.append(f"line {node.lineno}: imports vigil.ledger.queries")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "vigil.ledger"
            and any(a.name == "queries" for a in node.names)
        ):
            found.append(f"line {node.lineno}: imports vigil.ledger.queries")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("execute", "executemany", "copy")
            and node.args
            and isinstance(node.args[0], ast.Constant | ast.JoinedStr)
        ):
            # A statement written out at the call site (SQL text in a string).
            found.append(f"line {node.lineno}: .{node.func.attr}() of a literal statement")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_runs_no_sql_of_its_own(path):
    assert _violations(path.read_text(encoding="utf-8")) == []


def test_the_check_sees_a_query_import_and_a_literal_statement():
    # The rule above must be able to fail.
    assert _violations("from vigil.ledger.queries import Q\n")
    assert _violations("import vigil.ledger.queries\n")
    assert _violations("from vigil.ledger import queries\n")
    assert _violations("conn.execute('SELECT 1')\n")
    assert _violations("cur.copy(f'COPY {t} FROM STDIN')\n")
    assert not _violations("from vigil.ledger import claims\nawait claims.claim(conn, owned, [], 1, 1, 0.0, 3)\n")


def test_every_query_file_has_its_module():
    """One Python module per ``ledger/queries/*.sql``, same stem, for the files the worker and
    agent use."""
    ledger = ROOT / "ledger"
    for stem in (
        "agent",
        "approvals",
        "audit",
        "claims",
        "events",
        "finish",
        "partitions",
        "recovery",
        "tasks",
        "tracing",
    ):
        assert (ledger / "queries" / f"{stem}.sql").exists(), stem
        assert (ledger / f"{stem}.py").exists(), stem
