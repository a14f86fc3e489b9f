"""What a claim makes of its user's live journal: :func:`vigil.agent.journal.decide`, a pure
function over every case of docs/worker.md, "Durable runs" (no ledger: the worker carries the
decision out, tests/test_durable_runs.py and the ledger model test that on the real stack)."""

from __future__ import annotations

import pytest

from vigil.agent.journal import Decision, Found, Opening, decide, first_key, same_run

MAX = 3
KEY = "ann:7"  # the claim's: its user and first event


def test_no_journal_is_a_fresh_run_under_the_claims_key():
    assert decide(KEY, 1, [7], None, MAX) == Decision(Opening.FRESH, KEY)
    # A later attempt that finds no journal: an earlier attempt wrote nothing, but a key of its
    # own keeps it apart from any call the dropped journal made.
    assert decide(KEY, 2, [7], None, MAX) == Decision(Opening.FRESH, f"{KEY}~2")


def test_a_journal_without_a_start_is_dropped_and_the_run_starts_over():
    found = Found(KEY, None)
    assert decide(KEY, 2, [7], found, MAX) == Decision(Opening.DISCARDED, f"{KEY}~2")


@pytest.mark.parametrize("journal_key", [KEY, f"{KEY}~2"])
def test_this_runs_journal_is_replayed_with_its_start_events(journal_key):
    decision = decide(KEY, 2, [7], Found(journal_key, (7, 8)), MAX)
    assert decision == Decision(Opening.REPLAYED, journal_key, (7, 8), refused=Decision(Opening.DISCARDED, f"{KEY}~2"))
    assert decision.takes_up and not decision.drops_journal


def test_this_runs_last_attempt_with_its_own_events_replays_as_usual():
    decision = decide(KEY, MAX, [7, 8], Found(KEY, (7, 8)), MAX)
    assert (decision.opening, decision.start) == (Opening.REPLAYED, (7, 8))


def test_a_batchs_lone_last_attempt_replays_the_batch_alone_once():
    """Claim rule 3: the lead's last attempt claimed alone finds its batch's journal, lost only
    in company so far: the batch replays whole, uncounted; refused, the lead runs alone."""
    decision = decide(KEY, MAX, [7], Found(KEY, (7, 8)), MAX)
    assert decision == Decision(Opening.ALONE, KEY, (7, 8), refused=Decision(Opening.ISOLATED, f"{KEY}~{MAX}"))


def test_a_batch_that_crashed_alone_is_split_its_lead_runs_afresh():
    decision = decide(KEY, MAX, [7], Found(KEY, (7, 8), alone=True), MAX)
    assert decision == Decision(Opening.ISOLATED, f"{KEY}~{MAX}")
    assert decision.drops_journal and not decision.takes_up


def test_the_run_in_progress_goes_first():
    """An operator's retry of an older dead event (ann:5) overtook the user's run in progress
    (ann:7): that run is taken up; refused, its journal is dropped."""
    decision = decide("ann:5", 1, [5], Found(KEY, (7,)), MAX)
    assert decision == Decision(Opening.REPLAYED, KEY, (7,), refused=Decision(Opening.DISCARDED, "ann:5~1"))


def test_the_run_in_progress_due_its_lone_last_attempt_makes_the_claim_step_back():
    found = Found(KEY, (7,), lone_due=True)
    assert decide("ann:5", 1, [5], found, MAX).refused == Decision(Opening.STEPPED_BACK, "ann:5")
    # A last attempt is never spent on another event's run: it steps back or drops at once.
    assert decide("ann:5", MAX, [5], found, MAX) == Decision(Opening.STEPPED_BACK, "ann:5")
    assert decide("ann:5", MAX, [5], Found(KEY, (7,)), MAX) == Decision(Opening.DISCARDED, f"ann:5~{MAX}")


def test_keys_name_one_run():
    assert same_run("ann:7", "ann:7") and same_run("ann:7~3", "ann:7")
    assert not same_run("ann:70", "ann:7") and not same_run("ann:7", "ann:70")
    assert [first_key(KEY, n) for n in (1, 2)] == [KEY, f"{KEY}~2"]
