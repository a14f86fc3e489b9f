"""The producer API and chat messages: 202 only after the broker acknowledged, on the real
broker; bearer tokens (unknown 401, revoked 403 within the cache bound)."""

from __future__ import annotations

import json
import time

import httpx
import psycopg
import pytest

from ingest_support import cli, create_token, read_events, start_ingest
from support import wait_for


@pytest.fixture
def ingest(stack, ledger, topics):
    server = start_ingest(stack, ledger, topics, ingest_auth_cache_s=1.0)
    yield server
    server.stop()


@pytest.fixture
def client(ingest, ledger):
    token = create_token(ledger)["token"]
    with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        yield c


def envelope(n: int, **fields) -> dict:
    return {
        "user_id": f"user-{n % 3}",
        "source": "billing",
        "source_id": f"inv-{n}",
        "kind": "billing.invoice_paid",
        "payload": {"n": n},
        **fields,
    }


def test_single_event_is_on_the_topic_when_202_is_answered(client, stack, topics):
    response = client.post(
        "/v1/events",
        json=envelope(1, occurred_at="2026-03-01T09:30:00+09:00", headers={"traceparent": "00-abc-def-01"}),
    )
    assert response.status_code == 202, response.text
    assert response.json() == {"accepted": 1}
    [event] = read_events(stack.bootstrap, topics.events, 1, topics.partitions)
    assert (event.user_id, event.source, event.source_id, event.kind) == (
        "user-1",
        "billing",
        "inv-1",
        "billing.invoice_paid",
    )
    assert json.loads(event.payload) == {"n": 1}
    assert event.occurred_at.isoformat() == "2026-03-01T00:30:00+00:00"
    assert event.headers == {"traceparent": "00-abc-def-01"}
    assert abs(event.received_at.timestamp() - time.time()) < 30


def test_batch_is_acknowledged_whole(client, stack, topics):
    batch = [envelope(n) for n in range(20)]
    response = client.post("/v1/events", json={"events": batch})
    assert response.status_code == 202 and response.json() == {"accepted": 20}
    events = read_events(stack.bootstrap, topics.events, 20, topics.partitions)
    assert sorted(e.source_id for e in events) == sorted(f"inv-{n}" for n in range(20))


def test_unicode_and_empty_payloads(client, stack, topics):
    text = "承認をお願いします 🚀 — ünïcödé"
    assert client.post("/v1/events", json=envelope(1, user_id="ユーザー", payload={"t": text})).status_code == 202
    assert client.post("/v1/events", json=envelope(2, payload={})).status_code == 202
    no_payload = envelope(3)
    del no_payload["payload"]
    assert client.post("/v1/events", json=no_payload).status_code == 202
    events = {e.source_id: e for e in read_events(stack.bootstrap, topics.events, 3, topics.partitions)}
    assert events["inv-1"].user_id == "ユーザー" and json.loads(events["inv-1"].payload) == {"t": text}
    assert events["inv-2"].payload == "{}" and events["inv-3"].payload == "{}"


def test_chat_message_idempotency_key_is_the_source_id(client, stack, topics):
    first = client.post(
        "/v1/users/u-42/messages", json={"text": "hi there"}, headers={"Idempotency-Key": "client-key-1"}
    )
    retry = client.post(
        "/v1/users/u-42/messages", json={"text": "hi there"}, headers={"Idempotency-Key": "client-key-1"}
    )
    fresh = client.post("/v1/users/u-42/messages", json={"text": "and again"})
    assert first.status_code == retry.status_code == fresh.status_code == 202
    assert first.json()["source_id"] == retry.json()["source_id"] == "client-key-1"
    events = read_events(stack.bootstrap, topics.events, 3, topics.partitions)
    keys = [(e.source, e.source_id, e.kind) for e in events]
    # Both copies reach the broker; the ledger's UNIQUE key keeps one (test_ingest_process).
    assert keys.count(("chat", "client-key-1", "chat.message")) == 2
    assert ("chat", fresh.json()["source_id"], "chat.message") in keys
    assert all(e.user_id == "u-42" for e in events)


def test_producer_api_may_continue_a_conversation_with_a_chat_event(client, ledger, stack, topics):
    with psycopg.connect(ledger) as conn:  # the user's own session: another's, or none, is a 404 (issue 58)
        conn.execute("INSERT INTO sessions (id, user_id) VALUES ('ses-1', 'user-1')")
    body = envelope(1, source="chat", kind="chat.message", payload={"text": "and one more thing"}, session_id="ses-1")
    response = client.post("/v1/events", json=body)
    assert response.status_code == 202, response.text
    [event] = read_events(stack.bootstrap, topics.events, 1, topics.partitions)
    assert (event.source, event.session_id) == ("chat", "ses-1")


def test_a_message_naming_another_users_session_is_refused_like_another_users_delivery(client, ledger, stack, topics):
    """session_id must name a session of the message's user, as in_reply_to must name a
    delivery to them: another user's session, or one that never was, is a 404 and nothing
    is produced (before, a 202 and, silently, a new conversation)."""
    with psycopg.connect(ledger) as conn:
        conn.execute("INSERT INTO sessions (id, user_id) VALUES ('ses-mine', 'u-42'), ('ses-theirs', 'u-7')")
    for other in ("ses-theirs", "ses-never"):
        refused = client.post("/v1/users/u-42/messages", json={"text": "hi", "session_id": other})
        assert refused.status_code == 404, refused.text
        assert (refused.json()["error"], refused.json()["field"]) == ("unknown_session", "session_id")
        assert "u-7" not in refused.text
    own = client.post("/v1/users/u-42/messages", json={"text": "hi", "session_id": "ses-mine"})
    assert own.status_code == 202 and own.json()["session_id"] == "ses-mine", own.text
    [event] = read_events(stack.bootstrap, topics.events, 1, topics.partitions, settle=1.0)
    assert (event.user_id, event.session_id) == ("u-42", "ses-mine")


def test_producer_api_cannot_write_reserved_sources(client):
    for source in ("github", "approval", "timer"):
        response = client.post("/v1/events", json=envelope(1, source=source))
        assert response.status_code == 400
        assert response.json()["field"] == "source"


def test_missing_or_unknown_token_is_401(ingest):
    body = envelope(1)
    missing = httpx.post(f"{ingest.url}/v1/events", json=body)
    unknown = httpx.post(f"{ingest.url}/v1/events", json=body, headers={"Authorization": "Bearer vgl_not-a-real-token"})
    basic = httpx.post(f"{ingest.url}/v1/events", json=body, headers={"Authorization": "Basic dXNlcjpwYXNz"})
    for response in (missing, unknown, basic):
        assert response.status_code == 401
        assert response.json()["error"] == "unauthorized"
        assert response.headers["www-authenticate"].startswith("Bearer")


def test_revoked_token_is_403_within_the_cache_bound(ingest, ledger):
    created = create_token(ledger, "soon-revoked")
    headers = {"Authorization": f"Bearer {created['token']}"}
    assert httpx.post(f"{ingest.url}/v1/events", json=envelope(1), headers=headers).status_code == 202
    assert "revoked" in cli(ledger, "tokens", "revoke", created["id"])
    revoked_at = time.monotonic()

    def refused():
        response = httpx.post(f"{ingest.url}/v1/events", json=envelope(2), headers=headers)
        return response if response.status_code == 403 else None

    response = wait_for(refused, timeout=10, what="the revoked token to be refused")
    # The fixture's cache bound is 1 s (VIGIL_INGEST_AUTH_CACHE_S); allow for scheduling.
    assert time.monotonic() - revoked_at < 3
    assert response.json()["error"] == "token_revoked"
    listed = cli(ledger, "tokens", "list")
    assert created["id"] in listed and "revoked" in listed and created["token"] not in listed
