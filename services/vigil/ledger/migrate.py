"""Apply the ledger's migrations, in order, each in one transaction, recorded.

Safe to run from several replicas at once: a transaction-level advisory lock serialises
them, and the second one finds nothing left to do. A migration that fails rolls back whole
and stops the run, naming the file.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import psycopg

from vigil.paths import schemas_dir

log = logging.getLogger(__name__)

# Any constant works as long as every vigil process uses the same one; this is "vigil" in ASCII.
MIGRATION_LOCK_KEY = 0x766967696C
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def migrations_dir() -> Path:
    return schemas_dir() / "ledger" / "migrations"


def discover(folder: Path | None = None) -> list[Migration]:
    folder = folder or migrations_dir()
    found = []
    for path in sorted(folder.glob("*.sql")):
        match = _FILE.match(path.name)
        if not match:
            raise ValueError(f"migration file {path.name} is not named NNNN_name.sql")
        found.append(Migration(int(match.group(1)), match.group(2), path.read_text(encoding="utf-8")))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"two migrations share a version in {folder}")
    return found


def migrate(dsn: str, folder: Path | None = None) -> list[str]:
    """Apply every migration not yet recorded. Returns the names applied (empty: up to date).

    Each migration runs in its own transaction with its bookkeeping row, under the advisory
    lock; a crash mid-way leaves the earlier migrations applied and this one not at all.
    """
    applied: list[str] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            # CREATE TABLE IF NOT EXISTS is not safe against a concurrent creator by itself.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            conn.execute(BOOKKEEPING)
        for migration in discover(folder):
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
                row = conn.execute(
                    "SELECT checksum FROM schema_migrations WHERE version = %s", (migration.version,)
                ).fetchone()
                if row is not None:
                    if row[0] != migration.checksum:
                        log.warning("migration %04d_%s changed after it was applied", migration.version, migration.name)
                    continue
                try:
                    conn.execute(migration.sql)
                except psycopg.Error as exc:
                    raise RuntimeError(f"migration {migration.version:04d}_{migration.name} failed: {exc}") from exc
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                    (migration.version, migration.name, migration.checksum),
                )
                applied.append(f"{migration.version:04d}_{migration.name}")
    return applied


def apply_canonical(dsn: str) -> None:
    """Build a fresh database from schema.sql and mark every migration applied.

    For new installations and the test template: one file instead of the whole history,
    which the migration test proves gives the same schema.
    """
    schema = (schemas_dir() / "ledger" / "schema.sql").read_text(encoding="utf-8")
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        conn.execute(BOOKKEEPING)
        conn.execute(schema)
        for migration in discover():
            conn.execute(
                "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                (migration.version, migration.name, migration.checksum),
            )


def pending(dsn: str, folder: Path | None = None, connect_timeout: int = 5) -> list[str]:
    """Migrations this code knows that the ledger has not recorded (empty: up to date).

    Read-only, so an init container or a service at start-up can ask it without taking the
    migration lock. Versions the ledger has and this code does not (a newer release's
    migrations, during a rolling upgrade) are not "behind": migrations only add.
    """
    with psycopg.connect(dsn, connect_timeout=connect_timeout) as conn:
        found = conn.execute("SELECT to_regclass('schema_migrations')").fetchone()
        assert found is not None  # a SELECT without FROM returns one row
        if found[0] is None:
            done: set[int] = set()
        else:
            done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
    return [f"{m.version:04d}_{m.name}" for m in discover(folder) if m.version not in done]
