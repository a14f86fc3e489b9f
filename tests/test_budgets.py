"""Daily token budgets (docs/agent.md, "Budgets"): a run refused for its user's budget leaves
no run behind, a real worker waits and resumes, and one weighting bills tokens everywhere."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import psycopg
from psycopg.rows import dict_row

from support import query, scalar
from vigil.agent.base import RunResult
from vigil.ledger.states import RunOutcome
from vigil.worker.finish import Finished, commit_finished


def test_a_run_refused_for_the_budget_leaves_no_run_row(ledger):
    """A refused run was never started: its events wait (pending, the claim's attempt given
    back), and no runs row counts it as a failure; a neighbour in the same group commits."""
    from test_worker_claims import claim_pass, seed_pending  # the claim rules' own seeding

    seed_pending(ledger, 2)
    claims, _ = claim_pass(ledger, 2, "")
    refused, ran = sorted(claims, key=lambda c: c.user_id)
    started = datetime.now(UTC)
    group = [
        Finished(refused, started, error="budget: spent (1600 of 1500)", waiting=True, backoff_s=3600),
        Finished(ran, started, result=RunResult(RunOutcome.NOTHING)),
    ]

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await commit_finished(conn, group, "test-worker")

    committed, stale = asyncio.run(go())
    assert len(committed) == 2 and not stale
    assert [r["user_id"] for r in query(ledger, "SELECT user_id FROM runs")] == [ran.user_id]
    assert scalar(ledger, "SELECT count(*) FROM runs WHERE outcome = 'failed'") == 0
    [waiting] = query(
        ledger,
        "SELECT status, attempts, transient_failures, error, run_id,"
        " next_attempt_at > now() + interval '59 minutes' AS later FROM events WHERE user_id = %s",
        (refused.user_id,),
    )
    assert waiting["status"] == "pending" and (waiting["attempts"], waiting["transient_failures"]) == (0, 0)
    assert waiting["later"] and waiting["error"].startswith("budget: ") and waiting["run_id"] is None
