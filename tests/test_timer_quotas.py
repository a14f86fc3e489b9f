"""The timers API's quotas: per user and per token, checked atomically, and every 429 says
when to retry (docs/scheduler.md, "Quotas")."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ingest_support import create_token, ledger_count, start_ingest
from support import query
from vigil.httpserver import Refusal

PER_TOKEN = 3


@pytest.fixture
def ingest(stack, ledger, topics):
    server = start_ingest(stack, ledger, topics, max_timers_per_user=2, timer_quota_per_token=PER_TOKEN)
    yield server
    server.stop()


def client_for(ingest, ledger, name: str) -> httpx.Client:
    token = create_token(ledger, name)["token"]
    return httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def create(client: httpx.Client, user: str, timer_id: str = "t1") -> httpx.Response:
    return client.post(f"/v1/users/{user}/timers", json={"id": timer_id, "every": 3600})


def test_one_token_cannot_create_timers_past_its_quota_by_inventing_users(ingest, ledger):
    """Finding: quotas were per user only, so one token created 1,000 timers for each user
    id it invented."""
    with client_for(ingest, ledger, "a") as a, client_for(ingest, ledger, "b") as b:
        for n in range(PER_TOKEN):
            assert create(a, f"invented-{n}").status_code == 201
        over = create(a, "invented-99")
        assert over.status_code == 429, over.text
        assert over.json()["error"] == "quota_exceeded" and "VIGIL_TIMER_QUOTA_PER_TOKEN" in over.json()["detail"]
        assert int(over.headers["Retry-After"]) > 0
        # Re-registering one the token has is not a new timer; another token has its own quota.
        assert create(a, "invented-0").status_code == 200
        assert create(b, "invented-99").status_code == 201
        # Cancelling frees a place.
        assert a.delete("/v1/users/invented-1/timers/t1").status_code == 204
        assert create(a, "invented-98").status_code == 201
    assert ledger_count(ledger, "SELECT count(*) FROM timers WHERE NOT done") == PER_TOKEN + 1


def test_per_user_quota_still_holds_and_says_when_to_retry(ingest, ledger):
    with client_for(ingest, ledger, "a") as a:
        assert create(a, "u1", "t1").status_code == 201
        assert create(a, "u1", "t2").status_code == 201
        over = create(a, "u1", "t3")
    assert over.status_code == 429 and "VIGIL_MAX_TIMERS_PER_USER" in over.json()["detail"]
    assert int(over.headers["Retry-After"]) > 0


def test_concurrent_creates_for_many_users_never_pass_the_token_quota(ingest, ledger):
    """Twenty creates for twenty users at once with one token: exactly the quota succeeds
    (without the token's lock each create counted before the others committed)."""
    with client_for(ingest, ledger, "a") as a, ThreadPoolExecutor(20) as pool:
        statuses = sorted(pool.map(lambda n: create(a, f"racer-{n}").status_code, range(20)))
    assert statuses == [201] * PER_TOKEN + [429] * (20 - PER_TOKEN)
    assert query(ledger, "SELECT count(*) AS n FROM timers") == [{"n": PER_TOKEN}]


def test_every_429_carries_retry_after():
    """Every 429 vigil answers says when to retry, whoever raised it and whatever it forgot."""
    assert Refusal(429, "quota_exceeded", "x").response().headers["retry-after"].isdigit()
    assert Refusal(429, "rate_limited", "x", headers={"Retry-After": "7"}).response().headers["retry-after"] == "7"
