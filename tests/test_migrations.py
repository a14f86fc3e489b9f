"""Migrations: idempotent, and equal to the canonical schema.sql."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from support import query
from vigil.ledger.migrate import apply_canonical, discover, migrate


@pytest.fixture
def empty_db(stack):
    names = []

    def make() -> str:
        name = f"vigil_m_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
            stack.create_database(conn, name)
        names.append(name)
        return stack.dsn(name)

    yield make
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


SCHEMA_QUERIES = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity
        FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1, 2""",
    "storage": """
        SELECT relname, reloptions FROM pg_class
        WHERE relnamespace = 'public'::regnamespace AND reloptions IS NOT NULL ORDER BY 1""",
}


def describe(dsn: str) -> dict[str, list]:
    with psycopg.connect(dsn) as conn:
        return {name: conn.execute(sql).fetchall() for name, sql in SCHEMA_QUERIES.items()}


def test_migrations_twice_change_nothing(empty_db):
    dsn = empty_db()
    first = migrate(dsn)
    assert first == [f"{m.version:04d}_{m.name}" for m in discover()]
    before = describe(dsn)
    assert migrate(dsn) == []
    assert describe(dsn) == before


def test_schema_sql_equals_replayed_migrations(empty_db):
    from_migrations, from_schema = empty_db(), empty_db()
    migrate(from_migrations)
    apply_canonical(from_schema)
    left, right = describe(from_migrations), describe(from_schema)
    for part in SCHEMA_QUERIES:
        assert left[part] == right[part], f"{part} differ between migrations and schema.sql"
    # A canonical install counts as fully migrated.
    assert migrate(from_schema) == []


def test_concurrent_migrate_is_safe(empty_db):
    import threading

    dsn = empty_db()
    results, errors = [], []

    def run():
        try:
            results.append(migrate(dsn))
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(len(r) for r in results) == len(discover())


def test_queue_tables_are_vacuumed_after_a_few_thousand_dead_rows(ledger):
    """events and outbox are queues: the claim walks partial indexes that keep dead entries
    until VACUUM. With the default share-of-the-table threshold a busy ledger held twice as
    many dead rows as live ones and claims slowed by an order of magnitude."""
    # events keeps its queue (pending and running rows) in the partition events_live.
    rows = query(
        ledger,
        """SELECT relname, reloptions FROM pg_class
                            WHERE relname IN ('events_live', 'outbox') AND relnamespace = 'public'::regnamespace""",
    )
    options = {r["relname"]: dict(o.split("=") for o in r["reloptions"] or []) for r in rows}
    for table in ("events_live", "outbox"):
        assert options[table].get("autovacuum_vacuum_scale_factor") == "0.0", table
        assert int(options[table]["autovacuum_vacuum_threshold"]) <= 10_000, table


def test_history_tables_are_analyzed_after_a_million_changes_not_a_tenth(ledger):
    """event_keys, runs, outbox and every day of events_finished only grow: with the default
    threshold (a tenth of the table) a young table or a new day was analyzed at every autovacuum
    round under load, a burst of CPU that every event received meanwhile waited for (migrations
    0024 and 0025). The days made later, and those made over rows waiting in the default
    partition, too."""
    query(ledger, "SELECT ensure_event_partitions(0, ARRAY['2031-01-01'::date])")
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, received_at, status, finished_at)
           VALUES ('u1', 'chat', 'late-1', 'message', now(), 'done', '2031-01-02 12:00+00')""",
    )
    query(ledger, "SELECT ensure_event_partitions(0, ARRAY['2031-01-02'::date])")
    rows = query(
        ledger,
        """SELECT c.relname, c.reloptions FROM pg_class c
           WHERE c.relname IN ('event_keys', 'runs', 'outbox')
              OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'events_finished'::regclass)""",
    )
    options = {r["relname"]: dict(o.split("=") for o in r["reloptions"] or []) for r in rows}
    assert {
        "event_keys",
        "runs",
        "outbox",
        "events_finished_default",
        "events_finished_p20310101",
        "events_finished_p20310102",
    } <= set(options)
    for table, opts in options.items():
        assert opts.get("autovacuum_analyze_threshold") == "1000000", table


def test_migration_0011_converts_an_existing_ledger_keeping_every_row(empty_db, tmp_path):
    """A ledger from before the split (one events table holding its own dedup key) keeps
    every row, id and state; finished rows land in their day, the queue in events_live,
    every key in event_keys, and new events continue the ids."""
    import shutil

    from vigil.ledger.migrate import migrations_dir

    for path in migrations_dir().glob("*.sql"):
        if int(path.name[:4]) < 11:
            shutil.copy(path, tmp_path / path.name)
    dsn = empty_db()
    migrate(dsn, tmp_path)
    query(
        dsn,
        """INSERT INTO events (user_id, source, source_id, kind, received_at, recorded_at, status, attempts,
                              claim_epoch, finished_at)
           VALUES ('u', 'chat', 'old-done', 'chat.message', now(), now() - interval '9 days', 'done', 1, 1,
                   now() - interval '9 days'),
                  ('u', 'chat', 'old-dead', 'chat.message', now(), now() - interval '8 days', 'dead', 3, 1,
                   now() - interval '8 days'),
                  ('u', 'chat', 'waiting', 'chat.message', now(), now() - interval '8 days', 'pending', 0, NULL, NULL),
                  ('v', 'chat', 'claimed', 'chat.message', now(), now(), 'running', 1, 4, NULL)""",
    )
    before = query(dsn, "SELECT id, user_id, source, source_id, status, attempts, claim_epoch FROM events ORDER BY id")

    assert "0011_partitioned_events" in migrate(dsn)  # with any later migration
    after = query(dsn, "SELECT id, user_id, source, source_id, status, attempts, claim_epoch FROM events ORDER BY id")
    assert after == before
    parts = {
        r["source_id"]: r["part"] for r in query(dsn, "SELECT source_id, tableoid::regclass::text AS part FROM events")
    }
    assert parts["waiting"] == parts["claimed"] == "events_live"
    assert parts["old-done"].startswith("events_finished_p") and parts["old-dead"].startswith("events_finished_p")
    keys = query(dsn, "SELECT user_id, source, source_id FROM event_keys ORDER BY source_id")
    assert [k["source_id"] for k in keys] == ["claimed", "old-dead", "old-done", "waiting"]
    new = query(
        dsn,
        "INSERT INTO events (user_id, source, source_id, kind, received_at) VALUES ('w', 'chat', 'n', 'k', now()) "
        "RETURNING id",
    )[0]["id"]
    assert new > max(r["id"] for r in before)


def test_0021_links_earlier_writes_to_their_run_only_where_the_instant_names_one(empty_db, tmp_path):
    """Timers, memory files and tasks written before run ids were recorded get the run whose
    finish instant they carry, unless two runs of the user share that instant."""
    import shutil

    from vigil.ledger.migrate import migrations_dir

    for path in migrations_dir().glob("*.sql"):
        if int(path.name[:4]) < 21:
            shutil.copy(path, tmp_path / path.name)
    dsn = empty_db()
    migrate(dsn, tmp_path)
    with psycopg.connect(dsn) as conn:
        run = (
            "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome)"
            " VALUES (%s, 't', 0, 1, 'w', '{}', %s::timestamptz - interval '1 s', %s, 'message') RETURNING id"
        )
        alone = conn.execute(run, ("ann", "2026-01-01 10:00Z", "2026-01-01 10:00Z")).fetchone()[0]
        for _ in range(2):  # two runs of one group commit: the instant cannot tell them apart
            conn.execute(run, ("ben", "2026-01-01 11:00Z", "2026-01-01 11:00Z"))
        for user, at in (("ann", "2026-01-01 10:00Z"), ("ben", "2026-01-01 11:00Z")):
            conn.execute(
                "INSERT INTO timers (id, user_id, kind, due, created_at, updated_at)"
                " VALUES ('f', %s, 'followup', '2026-02-01Z', %s, '2026-01-01 12:00Z')",
                (user, at),
            )
            memory = "INSERT INTO memory (user_id, path, content, updated_at) VALUES (%s, '/memories/a', 'x', %s)"
            conn.execute(memory, (user, at))
            conn.execute(
                "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget,"
                " max_attempts, deadline, created_at) VALUES (%s, %s, 'k', 1, ARRAY[%s], 'i', 1, 1, '2026-02-01Z', %s)",
                (f"tsk_{user}", user, user, at),
            )
    assert migrate(dsn) == [f"{m.version:04d}_{m.name}" for m in discover() if m.version >= 21]
    for table in ("timers", "memory", "tasks"):
        rows = {r["user_id"]: r["run_id"] for r in query(dsn, f"SELECT user_id, run_id FROM {table}")}
        assert rows == {"ann": alone, "ben": None}, table
