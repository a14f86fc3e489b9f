"""The benchmarks' smoke mode: every figure comes out. Nothing here is about speed.

``python -m vigil_dev.bench --quick`` runs every workload tiny, on the test session's own stack
(through ``VIGIL_KAFKA_BOOTSTRAP`` and ``VIGIL_DATABASE_URL``), with real worker and ingest
processes, and must print a value for each figure and the summary.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from support import REPO, query
from vigil_dev.bench.__main__ import figure_names
from vigil_dev.bench.plan import QUICK

# Thirteen workloads (single-event runs, retention, per-event costs, two ledger shards, the model-bound runs, a
# rebalance and a rolling deploy under them): each starts its own worker, ingest or
# scripted-server processes, which is most of the smoke mode's time; the rolling deploy, twice
# over, about a minute. 194 s on a quiet machine, 274 s beside the parallel phase's other three
# workers (7 December 2026). The bound keeps `make test` bounded, not the bench fast.
QUICK_BUDGET_S = 420


BENCH = [sys.executable, "-m", "vigil_dev.bench"]


@pytest.mark.slow
# Asserts no speed, so it runs beside the other tests; it starts first (its worker then takes
# the short tests), so that the parallel phase does not end on it alone.
@pytest.mark.early
@pytest.mark.timeout(QUICK_BUDGET_S + 60)
def test_quick_bench_prints_every_figure_and_cleans_up(stack):
    """And ``--latency-curve``: more latency rounds at given shares of the saturated rate, so
    the knee (docs/performance.md, "Where the knee is") is a command, not a scratch script.
    One run for both: the curve needs the e2e workload, which is a fifth of the run's time."""
    env = {**os.environ, "VIGIL_KAFKA_BOOTSTRAP": stack.bootstrap, "VIGIL_DATABASE_URL": stack.admin_dsn}
    started = time.monotonic()
    result = subprocess.run(
        [*BENCH, "--quick", "--latency-curve", "0.3,0.4"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=QUICK_BUDGET_S + 30,
    )
    took = time.monotonic() - started
    output = result.stdout
    assert result.returncode == 0, f"exit {result.returncode}\n{output}\n{result.stderr[-4000:]}"
    for name in figure_names(QUICK):
        line = re.search(rf"^{re.escape(name)}: ([0-9.+-]+) \(min [0-9.+-]+, max [0-9.+-]+, \d+ ", output, re.MULTILINE)
        assert line, f"no value for {name}:\n{output}"
    assert re.search(r"^machine: \d+ cores", output, re.MULTILINE)
    assert re.search(r"^postgresql: \d+", output, re.MULTILINE)
    assert re.search(r"^kafka: ", output, re.MULTILINE)
    assert "summary (ratios against the targets" in output
    # River is skipped in --quick, and says so; its ratios too.
    assert "river: skipped in --quick" in output and "e2e_vs_river: skipped in --quick" in output
    # Each cost pass says where its rows and its WAL went (docs/performance.md, "What a single-event run writes").
    assert re.search(
        r"^    events_live: [0-9.]+ ins, [0-9.]+ upd \([0-9.]+ HOT\), [0-9.]+ del; index scans per run: ",
        result.stderr,
        re.M,
    ), result.stderr[-3000:]
    assert re.search(r"^  WAL by relation, per run \(bytes, records\): .*\bevents_live \d+ B", result.stderr, re.M), (
        result.stderr[-3000:]
    )
    curve = re.findall(
        r"^latency curve: (\S+) of e2e_events_per_s \((\d+) events/s\): p50 \d+ ms, p99 \d+ ms", output, re.M
    )
    rate = float(re.search(r"^e2e_events_per_s: ([0-9.]+)", output, re.M).group(1))
    assert [share for share, _ in curve] == ["0.30", "0.40"], output
    for (share, offered), expected in zip(curve, (0.3, 0.4), strict=True):
        assert abs(int(offered) - rate * expected) <= max(2, rate / 100), (share, offered, rate)
    assert took < QUICK_BUDGET_S, f"--quick took {took:.0f}s"
    # Everything the bench created is gone: its databases (and its topics, dropped with them).
    left = query(stack.admin_dsn, "SELECT datname FROM pg_database WHERE datname LIKE 'vigil_bench_%%'")
    assert left == [], left


def test_a_latency_curve_that_is_not_numbers_is_refused():
    bad = subprocess.run([*BENCH, "--latency-curve", "0.3,x"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--latency-curve: comma-separated numbers" in bad.stderr


def test_statements_are_named_after_their_query():
    """``--statements`` names a statement by its query's first line as PostgreSQL shows it
    (psycopg sends every placeholder as ``$n``, in the comments too): two queries whose
    first lines differ only there would print under one name."""
    from vigil.ledger.db import statement_names
    from vigil_dev.bench.sql import B
    from vigil_dev.bench.statements import _name, _names

    names = _names()
    counter = iter(range(1, 10_000))
    as_sent = lambda sql: re.sub(r"%\(\w+\)[sb]", lambda _: f"${next(counter)}", sql)  # noqa: E731
    for sql, name in statement_names().items():
        assert _name(as_sent(sql), names) == name
    for name, sql in B.items():
        assert _name(as_sent(sql), names) == f"bench:{name}"


def _wal_read_back(dsn: str, kept: bool) -> str:
    """Mark the WAL position, write, let two checkpoints pass, read the records since the mark."""
    import psycopg

    from vigil_dev.bench.sql import wal_kept

    with psycopg.connect(dsn, autocommit=True) as conn, wal_kept([dsn] if kept else []):
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        since = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        for _ in range(2):
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS scratch (n int)")
            conn.execute("INSERT INTO scratch SELECT generate_series(1, 1000)")
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
        try:
            conn.execute("SELECT count(*) FROM pg_get_wal_records_info(%s, pg_current_wal_lsn())", (since,)).fetchone()
        except psycopg.Error as exc:
            return exc.diag.message_primary or str(exc)
        return "read"


def test_the_wal_a_workload_reads_back_survives_a_checkpoint_meanwhile(stack):
    """The cost passes and the model-bound journal read their WAL back with pg_walinspect
    afterwards; on the test session's server, which other tests write too, a checkpoint came
    within seconds and recycled it (the quick bench failed in a parallel CI run: no
    model_bound_journal_wal_bytes_per_run). bench.sql.wal_kept holds it with a temporary slot."""
    assert _wal_read_back(stack.admin_dsn, kept=True) == "read"
    # Without a slot of its own the read fails, unless another one (a quick bench running
    # beside this test in the parallel phase) keeps the WAL for everyone.
    slots = "SELECT count(*) AS n FROM pg_replication_slots"
    before = query(stack.admin_dsn, slots)[0]["n"]
    unkept = _wal_read_back(stack.admin_dsn, kept=False)
    if before == 0 and query(stack.admin_dsn, slots)[0]["n"] == 0:
        assert "has already been removed" in unkept
