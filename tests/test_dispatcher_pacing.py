"""The pacing rule, the retry schedule and the signature, as pure functions (no ledger)."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import date, timedelta
from uuid import uuid4

import pytest

from dispatcher_support import T0
from vigil.dispatcher.channels import sign
from vigil.dispatcher.pacing import Action, Pacing, Row, plan, retry_delay, wake_at

GAP = 3600


def row(id_, urgent=False, status="pending", delivery=None, attempts=0, next_at=None, user="ana"):
    return Row(id_, user, 1, f"m{id_}", urgent, T0, status, delivery, attempts, next_at, T0 if delivery else None)


def pacing(last=None, urgent_day=None, urgent_count=0, cap=2, gap=GAP):
    return Pacing("ana", last, urgent_day, urgent_count, gap, cap)


def test_first_message_goes_at_once_and_later_ones_wait_for_the_gap():
    decision = plan(pacing(), [row(1)], T0, max_attempts=3)
    assert decision.action is Action.NEW and [r.id for r in decision.rows] == [1] and not decision.bypass
    assert plan(pacing(last=T0), [row(2)], T0 + timedelta(seconds=GAP - 1), 3) is None
    joined = plan(pacing(last=T0), [row(3), row(2)], T0 + timedelta(seconds=GAP), 3)
    assert [r.id for r in joined.rows] == [2, 3], "held messages are joined oldest first"


def test_a_question_with_a_deadline_is_never_held_by_the_urgent_cap():
    inside = T0 + timedelta(minutes=5)
    question = replace(row(2, urgent=True), deadline=T0 + timedelta(hours=1))
    for capped in (pacing(last=T0, urgent_day=T0.date(), urgent_count=2), pacing(last=T0, cap=0)):
        assert plan(capped, [row(1), row(2, urgent=True)], inside, 3) is None
        decision = plan(capped, [row(1), question], inside, 3)
        assert decision.bypass and [r.id for r in decision.rows] == [1, 2]


def test_urgent_bypasses_the_gap_until_the_days_cap_is_used():
    inside = T0 + timedelta(minutes=5)
    rows = [row(1), row(2, urgent=True)]
    decision = plan(pacing(last=T0), rows, inside, 3)
    assert decision.bypass and [r.id for r in decision.rows] == [1, 2]
    assert plan(pacing(last=T0, urgent_day=T0.date(), urgent_count=2), rows, inside, 3) is None
    # yesterday's count does not limit today
    assert plan(pacing(last=T0, urgent_day=date(2026, 3, 1), urgent_count=2), rows, inside, 3).bypass
    assert plan(pacing(last=T0, cap=0), rows, inside, 3) is None


def test_a_delivery_in_flight_holds_everything_behind_it():
    delivery = uuid4()
    later = T0 + timedelta(seconds=GAP * 2)
    waiting = [row(1, status="pending", delivery=delivery, attempts=1, next_at=later), row(2, urgent=True)]
    assert plan(pacing(last=T0), waiting, later - timedelta(seconds=1), 5) is None
    retry = plan(pacing(last=T0), waiting, later, 5)
    assert (retry.action, retry.delivery_id, [r.id for r in retry.rows], retry.lost) == (
        Action.RETRY,
        delivery,
        [1],
        False,
    )


def test_a_lost_send_is_retried_then_buried_when_out_of_attempts():
    delivery = uuid4()
    sending = [row(1, status="sending", delivery=delivery, attempts=2, next_at=T0)]
    decision = plan(pacing(last=T0), sending, T0, max_attempts=3)
    assert decision.action is Action.RETRY and decision.lost
    assert plan(pacing(last=T0), sending, T0, max_attempts=2).action is Action.BURY


def test_a_held_user_may_be_due_at_its_gaps_end_a_new_urgent_day_or_its_deliverys_backoff():
    """wake_at: when plan, which held, may say something else (the loop looks again then)."""
    inside = T0 + timedelta(minutes=5)
    assert wake_at(pacing(last=T0), [row(1)], inside) == T0 + timedelta(seconds=GAP)
    # Urgent past today's cap: the gap's end, or midnight (a new day, a new cap) if sooner.
    late = pacing(last=T0.replace(hour=23, minute=30), urgent_day=T0.date(), urgent_count=2)
    assert plan(late, [row(1, urgent=True)], late.last_delivery_at, 3) is None
    assert wake_at(late, [row(1, urgent=True)], late.last_delivery_at) == (T0 + timedelta(days=1)).replace(hour=0)
    # A fixed delivery waiting out its backoff (or lease) holds everything behind it until then.
    d = uuid4()
    waiting = [row(1, delivery=d, attempts=1, next_at=T0 + timedelta(seconds=40)), row(2)]
    assert plan(pacing(), waiting, inside - timedelta(minutes=5), 3) is None
    assert wake_at(pacing(), waiting, T0) == T0 + timedelta(seconds=40)
    assert wake_at(pacing(last=T0), [], inside) is None, "nothing held, nothing to look at"


def test_joined_messages_are_bounded():
    decision = plan(pacing(), [row(i) for i in range(1, 8)], T0, 3, max_messages=5)
    assert [r.id for r in decision.rows] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "attempt, retry_after, low, high",
    [
        (1, None, 30, 33),
        (2, None, 60, 66),
        (5, None, 480, 528),
        (12, None, 3600, 3600),
        (1, 120, 120, 120),
        (1, 10**9, 86_400, 86_400),
    ],
)
def test_retry_delay_doubles_is_capped_and_honours_retry_after(attempt, retry_after, low, high):
    delay = retry_delay(attempt, 30, 3600, retry_after, random.Random(7))
    assert low <= delay <= high


def test_signature_matches_the_standard_webhooks_published_example():
    signature = sign(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}'
    )
    assert signature == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
