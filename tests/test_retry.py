"""The one retry policy (services/vigil/retry.py): one backoff, and each loop's pauses."""

from __future__ import annotations

import random

import httpx
import psycopg
import pytest

from vigil import retry
from vigil.bus.kafka import ProduceError


def test_backoff_doubles_from_the_base_to_the_cap_with_jitter_under_it():
    rng = random.Random(3)
    for attempt, full in [(1, 1.0), (2, 2.0), (4, 8.0), (10, 60.0), (10**6, 60.0)]:
        delay = retry.backoff(attempt, 1.0, 60.0, rng=rng)
        assert full / 2 <= delay <= full


def test_a_jitter_above_one_stretches_but_never_past_the_cap():
    rng = random.Random(3)
    assert 30 <= retry.backoff(1, 30, 3600, jitter=(1.0, 1.1), rng=rng) <= 33
    assert retry.backoff(12, 30, 3600, jitter=(1.0, 1.1), rng=rng) == 3600


def test_retry_after_is_honoured_past_the_cap_up_to_its_own_limit():
    assert retry.backoff(1, 1.0, 60.0, retry_after_s=120) == 120
    assert retry.backoff(1, 1.0, 60.0, retry_after_s=10**9, retry_after_max_s=86_400) == 86_400


NOW = 1_445_412_480.0  # Wed, 21 Oct 2015 07:28:00 GMT


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"Retry-After": "120"}, 120.0),
        ({"Retry-After": " 1.5 "}, 1.5),
        ({"Retry-After": "Wed, 21 Oct 2015 07:30:00 GMT"}, 120.0),  # a date: measured from the caller's now
        ({"Retry-After": "Wed, 21 Oct 2015 07:20:00 GMT"}, 0.0),  # in the past: at once
        ({"Retry-After": "Wed, 21 Oct 2015 07:30:00 -0000"}, 120.0),  # no zone given: UTC
        ({"Retry-After": "-5"}, 0.0),
        ({"retry-after-ms": "2500", "Retry-After": "9"}, 2.5),  # the finer header wins
        ({"retry-after-ms": "soon", "Retry-After": "9"}, 9.0),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "nan"}, None),
        ({"Retry-After": "inf"}, None),
        ({"Retry-After": ""}, None),
        ({}, None),
    ],
)
def test_retry_after_is_read_once_for_every_caller(headers, seconds):
    assert retry.retry_after_seconds(httpx.Headers(headers), NOW) == seconds


def test_the_scheduler_doubles_from_its_tick_to_30s_and_starts_over_after_a_pass():
    policy = retry.scheduler_pass(1.0)
    assert [policy(RuntimeError("x"))[1] for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    policy.succeeded()
    assert policy(RuntimeError("x")) == ("error", 1.0)
    assert policy(ProduceError("x"))[0] == "broker"
    assert policy(psycopg.OperationalError("x"))[0] == "ledger"


@pytest.mark.parametrize(
    "policy, pause, retried, not_retried",
    [
        (retry.dispatcher_pass(), 2.0, psycopg.OperationalError("x"), OSError("x")),
        (retry.worker_claim_pass(), 1.0, OSError("x"), RuntimeError("x")),
    ],
)
def test_the_dispatcher_and_the_worker_pause_the_same_each_time_for_what_they_retry(
    policy, pause, retried, not_retried
):
    assert isinstance(retried, policy.retried) and not isinstance(not_retried, policy.retried)
    assert [policy(retried)[1] for _ in range(5)] == [pause] * 5
