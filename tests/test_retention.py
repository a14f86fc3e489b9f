"""Retention: finished work older than VIGIL_RETENTION_DAYS leaves the ledger, nothing else
does, and retention can never be shorter than the dedup window."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from support import query, scalar, wait_for
from vigil.ledger.db import connect
from vigil.ledger.events import prepare_record_connection, record_batch
from vigil.ledger.retention import drop_event_day, prune
from vigil.scheduler.settings import SchedulerSettings
from vigil.settings import SettingsError, load
from worker_support import metric


def seed(dsn: str) -> None:
    """Per table, rows old and finished (to go), and rows young or unfinished (to stay)."""
    old, young = "now() - interval '40 days'", "now() - interval '1 day'"
    query(
        dsn,
        f"""
        INSERT INTO events (user_id, source, source_id, kind, received_at, recorded_at, status, finished_at, attempts,
                            claim_epoch)
        VALUES ('u', 'chat', 'old-done-1', 'chat.message', {old}, {old}, 'done', {old}, 1, 1),
               ('u', 'chat', 'old-done-2', 'chat.message', {old}, {old}, 'done', {old}, 1, 1),
               ('u', 'chat', 'old-done-3', 'chat.message', {old}, {old}, 'done', {old}, 1, 1),
               ('u', 'chat', 'old-dead', 'chat.message', {old}, {old}, 'dead', {old}, 3, 1),
               ('u', 'chat', 'young-done', 'chat.message', {young}, {young}, 'done', {young}, 1, 1),
               ('u', 'chat', 'old-pending', 'chat.message', {old}, {old}, 'pending', NULL, 0, NULL),
               ('u', 'chat', 'old-running', 'chat.message', {old}, {old}, 'running', NULL, 1, 1)""",
    )
    query(
        dsn,
        f"""
        INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome)
        VALUES ('u', 'events', 0, 1, 'w', '{{1}}', {old}, {old}, 'message'),      -- its message delivered: goes
               ('u', 'events', 0, 1, 'w', '{{2}}', {old}, {old}, 'message'),      -- its message still pending: stays
               ('u', 'events', 0, 1, 'w', '{{3}}', {old}, {old}, 'nothing'),      -- no message: goes
               ('u', 'events', 0, 1, 'w', '{{5}}', {young}, {young}, 'nothing')   -- young: stays""",
    )
    runs = [r["id"] for r in query(dsn, "SELECT id FROM runs ORDER BY id")]
    query(
        dsn,
        f"""
        INSERT INTO outbox (user_id, run_id, epoch, body, created_at, status, delivered_at, dead_at)
        VALUES ('u', {runs[0]}, 1, 'delivered long ago', {old}, 'delivered', {old}, NULL),
               ('u', {runs[1]}, 1, 'still to deliver', {old}, 'pending', NULL, NULL),
               ('u', {runs[0]}, 1, 'given up long ago', {old}, 'dead', NULL, {old})""",
    )
    query(
        dsn,
        f"""
        INSERT INTO timers (id, user_id, kind, due, done, updated_at)
        VALUES ('fired', 'u', 'followup', date_trunc('second', {old}), true, {old}),
               ('live', 'u', 'followup', date_trunc('second', now()) + interval '1 day', false, {old}),
               ('fired-lately', 'u', 'followup', date_trunc('second', {young}), true, {young})""",
    )


def left(dsn: str) -> dict[str, list]:
    return {
        "events": [r["source_id"] for r in query(dsn, "SELECT source_id FROM events ORDER BY id")],
        "outbox": [r["body"] for r in query(dsn, "SELECT body FROM outbox ORDER BY id")],
        "runs": [r["event_ids"][0] for r in query(dsn, "SELECT event_ids FROM runs ORDER BY id")],
        "timers": [r["id"] for r in query(dsn, "SELECT id FROM timers ORDER BY id")],
    }


KEPT = {
    "events": ["young-done", "old-pending", "old-running"],
    "outbox": ["still to deliver"],
    "runs": [2, 5],
    "timers": ["fired-lately", "live"],
}


def test_prune_deletes_finished_work_past_retention_and_nothing_else(ledger):
    seed(ledger)
    with connect(ledger, autocommit=True) as conn:
        # Batches of two: the old events take two batches, the loop must go on after a full one.
        counts = prune(conn, retention_days=30, batch=2)
    assert counts == {"events": 4, "outbox": 2, "runs": 2, "timers": 1, "event_keys": 0}
    assert left(ledger) == KEPT
    with connect(ledger, autocommit=True) as conn:
        assert prune(conn, retention_days=30) == {"events": 0, "outbox": 0, "runs": 0, "timers": 0, "event_keys": 0}


def test_two_schedulers_pruning_at_once_share_the_work(ledger):
    """Replicas prune at the same time: each batch locks its rows SKIP LOCKED, so neither
    waits on the other, nothing is deleted twice and nothing is left behind."""
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, received_at, recorded_at, status,
                                         finished_at, attempts, claim_epoch)
                     SELECT 'u' || (g % 50), 'chat', 'old-' || g, 'chat.message', now() - interval '40 days',
                            now() - interval '40 days', 'done', now() - interval '40 days', 1, 1
                     FROM generate_series(1, 20000) AS g""",
    )
    results: list[dict] = []

    def one():
        with connect(ledger, autocommit=True) as conn:
            results.append(prune(conn, retention_days=30, batch=500))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2
    assert sum(r["events"] for r in results) == 20000
    assert scalar(ledger, "SELECT count(*) FROM events") == 0


def test_retention_shorter_than_the_dedup_window_is_refused(monkeypatch):
    monkeypatch.setenv("VIGIL_RETENTION_DAYS", "3")
    with pytest.raises(SettingsError) as caught:
        load(SchedulerSettings)
    assert "VIGIL_DEDUP_WINDOW_DAYS" in str(caught.value) and "VIGIL_RETENTION_DAYS (3)" in str(caught.value)
    monkeypatch.setenv("VIGIL_RETENTION_DAYS", "0")  # off: nothing is deleted, any window is fine
    assert load(SchedulerSettings).retention_days == 0
    result = subprocess.run(
        [sys.executable, "-m", "vigil", "scheduler"],
        env={"PATH": "/usr/bin:/bin", "VIGIL_RETENTION_DAYS": "3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "VIGIL_DEDUP_WINDOW_DAYS" in result.stderr and "Traceback" not in result.stderr


def test_the_scheduler_prunes_at_start(stack, ledger, topics, vigil_env, spawn):
    seed(ledger)
    env = {**vigil_env, "VIGIL_SCHEDULER_TICK_S": "0.2"}
    port = int(env["VIGIL_SCHEDULER_PORT"])
    spawn(["scheduler"], env, name="scheduler").wait_healthy(port)
    wait_for(lambda: left(ledger) == KEPT, 30, "old finished work pruned", interval=0.2)
    wait_for(
        lambda: metric(port, "vigil_ledger_pruned_rows_total", 'shard="0",table="events"') == 4, 10, "prune counted"
    )
    assert scalar(ledger, "SELECT count(*) FROM events") == 3


def record_via_worker(dsn: str, user_id: str, source: str, source_id: str) -> int:
    """The worker's own recording statement for one event; returns how many were new."""
    now = datetime.now(UTC)
    row = (1, user_id, source, source_id, "github.push", "{}", None, {}, None, now, "events", 0, 1)
    with connect(dsn) as conn:
        prepare_record_connection(conn)
        return record_batch(conn, [row], [], {})


def event_days(dsn: str) -> set[str]:
    return {
        r["relname"]
        for r in query(
            dsn,
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'events_finished'::regclass",
        )
    }


def test_a_retried_webhook_is_dropped_after_its_events_day_was(ledger):
    """The dedup key lives in event_keys for the dedup window, whatever happened to the
    event's partition: the provider's retry three days later is still a duplicate after
    retention (one day here) dropped the day of the first copy; past the window it is new."""
    assert record_via_worker(ledger, "u", "github", "delivery-1") == 1
    # The first copy ran three days ago.
    query(
        ledger,
        """UPDATE events SET status = 'done', finished_at = now() - interval '3 days', attempts = 1, claim_epoch = 1,
                             recorded_at = now() - interval '3 days'""",
    )
    query(ledger, "UPDATE event_keys SET recorded_at = now() - interval '3 days'")
    day = "events_finished_p" + (datetime.now(UTC) - timedelta(days=3)).strftime("%Y%m%d")
    with connect(ledger, autocommit=True) as conn:
        counts = prune(conn, retention_days=1, dedup_window_days=7)
    assert counts["events"] == 1 and counts["event_keys"] == 0
    assert day not in event_days(ledger)
    assert scalar(ledger, "SELECT count(*) FROM events") == 0

    assert record_via_worker(ledger, "u", "github", "delivery-1") == 0
    assert scalar(ledger, "SELECT count(*) FROM events") == 0
    assert record_via_worker(ledger, "u", "github", "delivery-2") == 1

    # Five days on, the first key is past the 7-day window: a copy now is a new event.
    with connect(ledger, autocommit=True) as conn:
        counts = prune(conn, retention_days=30, now=datetime.now(UTC) + timedelta(days=5), dedup_window_days=7)
    assert counts["event_keys"] == 1
    assert record_via_worker(ledger, "u", "github", "delivery-1") == 1


def test_dropping_a_day_drops_it_whole_and_fast_and_keeps_its_keys(ledger):
    """A day of finished events goes in one DROP: no row-by-row delete, a short lock on
    events whatever the day held (the bench's `retention_drop_day_s` does this with a
    million rows), and every dedup key stays."""
    n = 100_000
    query(ledger, "SELECT ensure_event_partitions(3, ARRAY[(now() AT TIME ZONE 'UTC' - interval '40 days')::date])")
    query(
        ledger,
        """WITH k AS (INSERT INTO event_keys (user_id, source, source_id, recorded_at)
                      SELECT 'u' || (g %% 500), 'chat', 'm-' || g, now() - interval '40 days'
                      FROM generate_series(1, %(n)s) g
                      RETURNING user_id, source, source_id, recorded_at)
           INSERT INTO events (user_id, source, source_id, kind, received_at, recorded_at, status, finished_at,
                               attempts, claim_epoch)
           SELECT user_id, source, source_id, 'chat.message', recorded_at, recorded_at, 'done', recorded_at, 1, 1
           FROM k""",
        {"n": n},
    )
    day = "events_finished_p" + (datetime.now(UTC) - timedelta(days=40)).strftime("%Y%m%d")
    with connect(ledger, autocommit=True) as conn:
        began = time.monotonic()
        dropped = drop_event_day(conn, day)
        took = time.monotonic() - began
    assert dropped == n
    assert took < 1.0, f"dropping a day of {n} events took {took:.2f} s"
    assert day not in event_days(ledger)
    assert scalar(ledger, "SELECT count(*) FROM events") == 0
    # The keys stay for the dedup window (counted from now: 40 days old here, so the next
    # prune with a 7-day window deletes them, in batches, which is the keys' own retention).
    assert scalar(ledger, "SELECT count(*) FROM event_keys") == n


def test_the_pruner_judges_journal_retention_on_its_clock(ledger):
    """A journal kept (VIGIL_RUN_JOURNAL_DAYS=2) that finished a moment ago on the ledger's
    clock is past its days on the pruner's, three days ahead: the pruner drops it. Retention
    follows the scheduler's clock, not the database's now()."""
    from vigil.clock import ManualClock
    from vigil.scheduler.pruner import Pruner

    query(
        ledger,
        "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body, finished_at)"
        " VALUES ('kim:1', 1, 'model', 'kim', 1, 1, '{}', now())",
    )
    pruned: list[dict[str, int]] = []
    stopping = threading.Event()
    clock = ManualClock(time.time() + 3 * 86_400)
    Pruner(ledger, 0, stopping, on_pruned=pruned.append, journal_days=2, clock=clock).start()
    try:
        wait_for(lambda: pruned, 30, "a prune")
    finally:
        stopping.set()
    assert pruned[0]["run_journal"] == 1, pruned
    assert scalar(ledger, "SELECT count(*) FROM run_journal") == 0
