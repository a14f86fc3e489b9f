"""The bench's peer: River's CLI built from its pinned Go module, ``river bench`` on a database
of its own, and a machine that cannot build it printing the figure as pending without failing."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys

import psycopg
import pytest

from support import REPO, query
from vigil_dev.bench import river
from vigil_dev.bench.figures import Report
from vigil_dev.bench.plan import FULL
from vigil_dev.bench.stack import BenchStack

pytestmark = pytest.mark.tools  # River's CLI, Go-built: `make test` runs these after the parallel phase


def test_river_gets_a_url_with_every_connection_parameter():
    """River's CLI takes only ``postgresql://`` URLs; a named stack's DSN is a libpq key=value
    string, whose user and password may hold any character."""
    conninfo = psycopg.conninfo.make_conninfo(
        host="127.0.0.1",
        port=5433,
        user="bench user",
        password="p@ss/w:rd?#%",
        dbname="vigil_bench_river_0",
        sslmode="disable",
        application_name="bench",
    )
    url = river.url(conninfo)
    assert url.startswith("postgresql://")
    assert psycopg.conninfo.conninfo_to_dict(url) == psycopg.conninfo.conninfo_to_dict(conninfo)


@pytest.mark.slow
def test_a_machine_that_cannot_build_river_prints_it_pending_and_the_bench_does_not_fail(stack):
    """No Go, or no room for the cache: the figure and its ratios say why, exit status 0."""
    env = {
        **os.environ,
        "VIGIL_KAFKA_BOOTSTRAP": stack.bootstrap,
        "VIGIL_DATABASE_URL": stack.admin_dsn,
        "VIGIL_TOOLS_DIR": "/dev/null/tools",  # the build cannot make its cache folder
    }
    done = subprocess.run(
        [sys.executable, "-m", "vigil_dev.bench", "--only", "river"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{done.stderr[-3000:]}"
    assert "peer_river_jobs_per_s: pending (River's CLI not built: build-river.sh exited 1: mkdir:" in out, out
    assert "e2e_vs_river: missing input (River's CLI not built: " in out, out
    assert "single_event_runs_vs_river: missing input (River's CLI not built: " in out, out
    assert "figures without a value" not in out, out


def test_the_quick_bench_skips_river_and_says_so():
    report = Report(out=io.StringIO())
    river.river(None, dataclasses.replace(FULL, river_seconds=0.0, name="quick"), report)  # type: ignore[arg-type]
    lines = []
    river.summary(report, dataclasses.replace(FULL, river_seconds=0.0, name="quick"), lambda *a: lines.append(a))
    assert "river: skipped in --quick" in report.out.getvalue()
    assert [(label, text) for label, _, text, _ in lines] == [
        ("e2e_vs_river", "skipped in --quick"),
        ("single_event_runs_vs_river", "skipped in --quick"),
    ]


@pytest.mark.slow
@pytest.mark.timeout(river.BUILD_TIMEOUT_S + 120)  # a first build on a fresh machine (`make tools` does it first)
def test_river_bench_runs_on_a_database_of_its_own_and_drops_it(stack, monkeypatch):
    monkeypatch.setenv("VIGIL_KAFKA_BOOTSTRAP", stack.bootstrap)
    monkeypatch.setenv("VIGIL_DATABASE_URL", stack.admin_dsn)
    report = Report(out=io.StringIO())
    plan = dataclasses.replace(FULL, rounds=1, river_seconds=2.0)
    with BenchStack.open() as bench:
        river.river(bench, plan, report)
    figure = report.figures["peer_river_jobs_per_s"]
    assert figure.value and figure.value > 0, report.out.getvalue()
    assert "River v0.47.0, `river bench --duration 2s`" in figure.note
    left = query(stack.admin_dsn, "SELECT datname FROM pg_database WHERE datname LIKE 'vigil_bench_river_%%'")
    assert left == [], left


def test_a_failing_river_command_never_prints_the_password(tmp_path):
    """River's CLI quotes the database URL in its errors: the bench's message (printed as the
    figure's pending reason) must not carry the password."""
    fake = tmp_path / "river"
    fake.write_text('#!/bin/sh\necho "Error: could not connect to $3" >&2\nexit 1\n')
    fake.chmod(0o755)
    password = "s3cret/+pw"
    target = river.url(psycopg.conninfo.make_conninfo(host="127.0.0.1", user="u", password=password, dbname="d"))
    with pytest.raises(RuntimeError) as failed:
        river._river(str(fake), ["migrate-up", "--database-url", target], 10, password)
    assert "could not connect to postgresql://u:***@127.0.0.1/d" in str(failed.value)
    assert password not in str(failed.value) and "s3cret" not in str(failed.value)
