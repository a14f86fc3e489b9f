"""One door to PostgreSQL: only ``vigil.ledger`` runs SQL or opens connections.

Every statement the product runs sits in ``services/vigil/ledger/queries/*.sql`` and is run by
the typed function of the ledger module with the same stem; connections and pools are built by
``vigil.ledger.db`` (docs/architecture.md, "One door to PostgreSQL"). So a plan regression
has one place to be tested and the set of statements is one folder. This test reads the
source of every other product module (the AST, not text: a comment or a docstring naming
``Q.claim`` is fine) and refuses:

- importing the query loader (``vigil.ledger.queries``);
- importing psycopg_pool, or psycopg's connect (``psycopg.connect``,
  ``Connection.connect``, ``AsyncConnection.connect``);
- calling ``.execute(``, ``.executemany(``, ``.cursor(`` or a cursor's ``.copy(sql)`` on
  anything, except the calls listed in ``NOT_SQL``.

The tooling (``services/vigil_dev``) is not the product: the bench measures raw PostgreSQL
with its own connections and SQL.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PRODUCT = Path(__file__).resolve().parents[1] / "services" / "vigil"
LEDGER = PRODUCT / "ledger"

# Calls named like SQL that are not SQL: (module path, the call's callee as written).
NOT_SQL = {
    # The agent's memory tool runs the model's file command (view, create, str_replace) on
    # the run's in-memory copy of the user's memory; the ledger writes it at the finish.
    ("agent/conversation.py", "self.run.memory.execute"),
    # ... and MemoryFiles.answer, the same command as a tool result (a memory review's tool).
    ("agent/memory.py", "self.execute"),
}

SQL_METHODS = {"execute", "executemany", "cursor"}
CONNECT_OWNERS = {"Connection", "AsyncConnection"}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def violations(source: str, path: str) -> list[Violation]:
    """What in ``source`` (the text of product module ``path``) breaks the one-door rule."""
    found: list[Violation] = []
    psycopg_names = {"psycopg"}  # names bound to the psycopg module (import psycopg as pg)

    def flag(node: ast.AST, what: str) -> None:
        found.append(Violation(path, getattr(node, "lineno", 0), what))

    tree = ast.parse(source, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "psycopg":
                    psycopg_names.add(alias.asname or "psycopg")
                if alias.name == "psycopg_pool" or alias.name.startswith("psycopg_pool."):
                    flag(node, f"imports {alias.name}")
                if alias.name == "vigil.ledger.queries":
                    flag(node, "imports the query loader vigil.ledger.queries")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {alias.name for alias in node.names}
            if module == "psycopg_pool" or module.startswith("psycopg_pool."):
                flag(node, f"imports from {module}")
            if module == "vigil.ledger.queries" or (module == "vigil.ledger" and "queries" in names):
                flag(node, "imports the query loader vigil.ledger.queries")
            if module == "psycopg" and "connect" in names:
                flag(node, "imports psycopg.connect")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            owner = node.func.value
            callee = ast.unparse(node.func)
            if method == "connect":
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if owner_name in CONNECT_OWNERS or (isinstance(owner, ast.Name) and owner.id in psycopg_names):
                    flag(node, f"opens a connection: {callee}(...)")
            elif method in SQL_METHODS or (method == "copy" and node.args):
                if (path, callee) not in NOT_SQL:
                    flag(node, f"runs SQL: {callee}(...)")
    return found


def product_modules() -> list[Path]:
    return sorted(p for p in PRODUCT.rglob("*.py") if LEDGER not in p.parents)


def test_only_the_ledger_runs_sql_or_opens_connections():
    modules = product_modules()
    assert len(modules) > 50  # the walk found the product, not an empty folder
    offenders = []
    for module in modules:
        rel = module.relative_to(PRODUCT).as_posix()
        offenders.extend(violations(module.read_text(encoding="utf-8"), rel))
    assert not offenders, "SQL or connections outside vigil.ledger (use a typed function of the ledger):\n" + "\n".join(
        str(v) for v in offenders
    )


def test_not_sql_exceptions_are_still_there():
    """An exception for a call that no longer exists would silently widen the rule."""
    for rel, callee in NOT_SQL:
        tree = ast.parse((PRODUCT / rel).read_text(encoding="utf-8"))
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert callee in calls, f"{rel}: no call {callee}(...) any more; drop it from NOT_SQL"


PLANTED = {
    "from vigil.ledger.queries import Q": "query loader",
    "from vigil.ledger import queries": "query loader",
    "import vigil.ledger.queries": "query loader",
    "import psycopg_pool": "psycopg_pool",
    "from psycopg_pool import AsyncConnectionPool": "psycopg_pool",
    "from psycopg import connect": "psycopg.connect",
    "import psycopg\nconn = psycopg.connect('')": "opens a connection",
    "import psycopg as pg\nconn = pg.connect('')": "opens a connection",
    "import psycopg\nasync def f():\n    await psycopg.AsyncConnection.connect('')": "opens a connection",
    "from psycopg import Connection\nConnection.connect('')": "opens a connection",
    "def f(conn):\n    conn.execute('SELECT 1')": "runs SQL",
    "async def f(pool):\n    async with pool.connection() as c:\n        await c.execute('x', {})": "runs SQL",
    "def f(cur):\n    cur.executemany('x', [])": "runs SQL",
    "def f(conn):\n    conn.cursor()": "runs SQL",
    "def f(cur):\n    cur.copy('COPY t FROM STDIN')": "runs SQL",
    "def f(cur, t):\n    cur.copy(f'COPY {t} FROM STDIN')": "runs SQL",
}


def test_every_query_file_has_its_module():
    """One Python module per ``ledger/queries/*.sql``, same stem: the only runner of its statements."""
    stems = sorted(path.stem for path in (LEDGER / "queries").glob("*.sql"))
    assert len(stems) > 10
    assert [stem for stem in stems if not (LEDGER / f"{stem}.py").exists()] == []


def test_planted_violations_are_caught():
    """The checker itself: each planted breach is reported, and clean code is not."""
    for source, expected in PLANTED.items():
        found = violations(source, "scheduler/planted.py")
        assert found, f"not caught: {source!r}"
        assert any(expected in v.what for v in found), (source, [str(v) for v in found])
    clean = (
        "import psycopg\n"
        "from vigil.ledger import timers, db\n"
        "def f(conn: psycopg.Connection, d: dict):\n"
        "    '''conn.execute(Q.timer_get) in a docstring is fine'''\n"
        "    d.copy()\n"
        "    return timers.get(conn, 'u', 't'), db.connect('dsn')\n"
    )
    assert violations(clean, "scheduler/clean.py") == []
    # The memory tool's call is excepted in its own module only.
    memory_call = "def f(self, args):\n    return self.run.memory.execute(args)"
    assert violations(memory_call, "agent/conversation.py") == []
    assert violations(memory_call, "scheduler/loop.py")
