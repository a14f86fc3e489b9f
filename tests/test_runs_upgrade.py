"""`vigil runs upgrade` on the ledger: which in-flight runs it moves, what it records, and its
refusals (docs/agent.md, "Changing an agent safely"). A worker replaying a moved run is
tests/test_durable_runs.py::test_an_upgraded_run_goes_on_under_the_new_version_and_repeats_nothing.

The journals here are written straight into ``run_journal`` as a worker leaves them: step 1 a
model answer whose start records the profile version, then action calls with or without an
outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import query, scalar


def vigil(ledger: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VIGIL_DATABASE_URL": ledger}
    return subprocess.run([sys.executable, "-m", "vigil", *args], env=env, capture_output=True, text=True, timeout=60)


def ok(ledger: str, *args: str) -> subprocess.CompletedProcess:
    done = vigil(ledger, *args)
    assert done.returncode == 0, done.stderr
    return done


def journal(ledger: str, run_key: str, profile: tuple[str, int] | None, calls=(), finished: bool = False) -> None:
    """A run's journal: its start (step 1) on ``profile``, then ``calls`` (done: an outcome)."""
    user = run_key.rpartition(":")[0]
    start = {"events": [1], "now": "2026-12-06T20:00:00+00:00", "system": [], "profile": profile}
    rows = [(1, "model", {"content": [], "usage": {}, "start": start}, None)]
    for step, (name, done) in enumerate(calls, start=2):
        outcome = {"text": "ok", "is_error": False} if done else None
        rows.append((step, "call", {"name": name, "input": {}, "key": f"{run_key}:{step}"}, outcome))
    for step, kind, body, outcome in rows:
        query(
            ledger,
            "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body, outcome, finished_at)"
            " VALUES (%s, %s, %s, %s, 1, 1, %s::json, %s::json, CASE WHEN %s THEN now() END)",
            (run_key, step, kind, user, json.dumps(body), outcome and json.dumps(outcome), finished),
        )


def written(ledger: str) -> tuple[int, int]:
    return (
        scalar(ledger, "SELECT count(*) FROM run_upgrades"),
        scalar(ledger, "SELECT count(*) FROM audit WHERE action = 'runs.upgrade'"),
    )


def test_an_unknown_profile_or_version_or_one_not_newer_is_refused_with_exit_2(ledger):
    done = vigil(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "2")
    assert done.returncode == 2 and "no such profile" in done.stderr, done.stderr
    ok(ledger, "profiles", "create", "refunds", "--model", "claude-v1")
    ok(ledger, "profiles", "update", "refunds", "--model", "claude-v2")
    journal(ledger, "ann:1", ("refunds", 1))

    done = vigil(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "3")
    assert done.returncode == 2 and "profile refunds has versions 1 to 2" in done.stderr, done.stderr
    done = vigil(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "1")
    assert done.returncode == 2 and "not newer than any version of refunds" in done.stderr, done.stderr
    done = vigil(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "0")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert written(ledger) == (0, 0)


def test_it_moves_the_live_runs_of_older_versions_only_and_records_who_and_how_many(ledger):
    ok(ledger, "profiles", "create", "refunds", "--model", "claude-v1")
    ok(ledger, "profiles", "update", "refunds", "--model", "claude-v2")
    ok(ledger, "profiles", "update", "refunds", "--model", "claude-v3")
    ok(ledger, "profiles", "create", "sales", "--model", "claude-v1")
    ok(ledger, "profiles", "update", "sales", "--model", "claude-v2")
    journal(ledger, "ann:1", ("refunds", 1), calls=[("http_request", True), ("http_request", False)])
    journal(ledger, "eve:5", ("refunds", 2))
    journal(ledger, "bob:2", ("refunds", 3))  # on the version already
    journal(ledger, "cat:3", ("refunds", 1), finished=True)  # finished (kept): not in flight
    journal(ledger, "dan:4", ("sales", 1))  # another profile
    journal(ledger, "fay:6", None)  # the default profile
    journal(ledger, "task:tsk_1", ("refunds", 1))  # a background task keeps its run's version

    dry = json.loads(
        ok(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "3", "--dry-run", "--json").stdout
    )
    assert (dry["moved"], dry["dry_run"]) == (2, True), dry
    assert written(ledger) == (0, 0)
    [ann, eve] = dry["runs"]
    assert (ann["run_key"], ann["from_version"], ann["calls_done"], ann["calls_in_doubt"]) == ("ann:1", 1, 1, 1), ann
    assert (eve["run_key"], eve["from_version"], eve["state"]) == ("eve:5", 2, "awaiting replay"), eve

    text = ok(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "3").stdout
    assert "moved 2 run(s) in flight on older versions of refunds to version 3" in text, text
    assert "the 1 call(s) with an outcome are not executed again" in text, text
    rows = query(
        ledger, "SELECT run_key, profile, from_version, to_version, made_by FROM run_upgrades ORDER BY run_key"
    )
    assert [(r["run_key"], r["from_version"], r["to_version"]) for r in rows] == [("ann:1", 1, 3), ("eve:5", 2, 3)]
    [audit] = query(ledger, "SELECT actor, detail FROM audit WHERE action = 'runs.upgrade'")
    assert audit["actor"] == rows[0]["made_by"] and audit["actor"]
    assert audit["detail"] == {
        "profile": "refunds",
        "to_version": 3,
        "runs": 2,
        "from_versions": [1, 2],
        "run_keys": ["ann:1", "eve:5"],
    }

    # The run shows where it was moved.
    shown = json.loads(ok(ledger, "runs", "show", "ann:1", "--json").stdout)
    assert [(u["from_version"], u["to_version"]) for u in shown["upgrades"]] == [(1, 3)], shown["upgrades"]
    assert "moved from refunds v1 to v3 by" in ok(ledger, "runs", "show", "ann:1").stdout

    # Moved runs are on version 3 now: a second upgrade to it moves nothing (and says so).
    again = json.loads(ok(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "3", "--json").stdout)
    assert (again["moved"], again["runs"]) == (0, []), again
    assert written(ledger) == (2, 2)
