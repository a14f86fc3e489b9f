"""Operator commands against a real ledger: `vigil dead list|retry`, `vigil inbox`, `vigil runs show`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import query


def vigil(ledger: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VIGIL_DATABASE_URL": ledger}
    return subprocess.run([sys.executable, "-m", "vigil", *args], env=env, capture_output=True, text=True, timeout=60)


def seed(ledger: str) -> None:
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, status, attempts,
                             finished_at, error)
           VALUES ('ann', 'chat', 'a1', 'chat.message', '{}', now(), 'dead', 3, now(), 'dead after 3 attempts: boom'),
                  ('ann', 'chat', 'a2', 'chat.message', '{}', now(), 'done', 1, now(), NULL)""",
    )


def test_dead_list_and_retry_with_audit(ledger):
    seed(ledger)
    listed = vigil(ledger, "dead", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {r.pop("dead") for r in rows} == {"event"}
    assert [(r["source_id"], r["attempts"]) for r in rows] == [("a1", 3)]
    dead_id = rows[0]["id"]
    done_id = query(ledger, "SELECT id FROM events WHERE source_id = 'a2'")[0]["id"]

    result = vigil(ledger, "dead", "retry", str(dead_id), str(done_id), "--actor", "oncall")
    assert result.returncode == 0, result.stderr
    assert "retried 1 event(s)" in result.stdout and str(done_id) in result.stdout
    row = query(ledger, "SELECT status, attempts, retried_by, finished_at FROM events WHERE id = %s", (dead_id,))[0]
    assert row == {"status": "pending", "attempts": 0, "retried_by": "oncall", "finished_at": None}
    assert query(ledger, "SELECT status FROM events WHERE id = %s", (done_id,))[0]["status"] == "done"
    audit = query(ledger, "SELECT actor, action, detail FROM audit")
    assert audit == [
        {"actor": "oncall", "action": "dead.retry", "detail": {"requested": [dead_id, done_id], "retried": [dead_id]}}
    ]


def test_inbox_shows_states(ledger):
    seed(ledger)
    result = vigil(ledger, "inbox", "ann")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:5] == ["id", "source", "source_id", "kind", "status"]
    assert any("dead" in line for line in lines) and any("done" in line for line in lines)


# Issue 58: every number an operator types goes through vigil.numbers (ASCII digits, a
# range the ledger column holds): "²" passed str.isdigit() to int(), 20 digits reached the
# ledger, and each printed a Python traceback. Now: one usage line, exit 2.
ODD_NUMBERS = ["\u00b2", "\u2461", "\u0661\u0662", " 5", "1_0", "9" * 20, "-1", "1e3", "nan"]
NUMBER_COMMANDS = [
    ["runs", "show", "{}"],
    ["runs", "show", "ann:{}"],
    ["dead", "list", "--limit", "{}"],
    ["dead", "retry", "{}"],
    ["inbox", "ann", "--limit", "{}"],
    ["tasks", "list", "--limit", "{}"],
    ["memory", "history", "ann", "--limit", "{}"],
    ["memory", "history", "ann", "--before", "{}"],
    ["memory", "revert", "ann", "{}"],
    ["approvals", "list", "--limit", "{}"],
    ["outbox", "ann", "--limit", "{}"],
    ["channels", "set", "ann", "--type", "log", "--gap", "{}"],
    ["timers", "add", "ann", "t1", "--due", "2000000000", "--every", "{}"],
    ["hooks", "revoke-secret", "h1", "{}"],
    ["profiles", "show", "p1", "--version", "{}"],
    ["profiles", "create", "p1", "--max-turns", "{}"],
    ["profiles", "create", "p1", "--run-wall-s", "{}"],
    ["shards", "move", "{}", "--to", "1"],
    ["topics", "--timeout", "{}"],
]


@pytest.mark.parametrize("odd", ODD_NUMBERS)
@pytest.mark.parametrize("command", NUMBER_COMMANDS, ids=" ".join)
def test_an_odd_number_at_the_cli_is_a_usage_line_not_a_traceback(command, odd):
    from click.testing import CliRunner

    from vigil.cli import main

    args = [part.replace("{}", odd) for part in command]
    result = CliRunner().invoke(main, args, env={"VIGIL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none"})
    assert result.exit_code == 2, (args, result.output, result.exception)
    assert "Traceback" not in result.output and "\nError: " in result.output, result.output


def test_runs_show_finds_a_finished_run_without_a_journal_by_the_key_it_printed(ledger):
    """A finished run keeps no journal by default: `vigil runs show ID` prints its key, and
    `vigil runs show KEY` must find the run through its first event, not say `no run`."""
    import asyncio
    from datetime import UTC, datetime

    import psycopg
    from psycopg.rows import dict_row

    from test_worker_claims import claim_pass, seed_pending  # the claim rules' own seeding
    from vigil.agent.base import RunResult
    from vigil.ledger.states import RunOutcome
    from vigil.worker.finish import Finished, commit_finished

    seed_pending(ledger, 1, per_user=2)
    [claim], _ = claim_pass(ledger, 1, "")

    async def finish():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await commit_finished(
                conn, [Finished(claim, datetime.now(UTC), result=RunResult(RunOutcome.NOTHING))], "w"
            )

    asyncio.run(finish())
    assert query(ledger, "SELECT count(*) AS n FROM run_journal")[0]["n"] == 0
    run_id = query(ledger, "SELECT id FROM runs")[0]["id"]
    by_id = vigil(ledger, "runs", "show", str(run_id))
    assert by_id.returncode == 0, by_id.stderr
    key = by_id.stdout.split("key ", 1)[1].split()[0]
    by_key = vigil(ledger, "runs", "show", key, "--json")
    assert by_key.returncode == 0, f"`vigil runs show {key}` refused the key it printed: {by_key.stderr}"
    assert json.loads(by_key.stdout)["run"]["id"] == run_id
