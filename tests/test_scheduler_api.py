"""Creating timers: the validation rules, and the HTTP API as mounted on a real `vigil ingest`,
with a real `vigil scheduler` firing what the API created."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from scheduler_support import read_topic, topic_size
from support import query, wait_for
from vigil.scheduler.timers import MAX_PAYLOAD_BYTES, InvalidTimer, parse_due, parse_timer

NOW = 1_767_603_600  # 2026-01-05T09:00:00Z


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (NOW, NOW),
        ("1767603600", NOW),
        ("2026-01-05T09:00:00Z", NOW),
        ("2026-01-05T04:00:00-05:00", NOW),
        ("2026-01-05T08:59:59.200Z", NOW),  # a fraction rounds up: never fire early
        (NOW - 0.5, NOW),
    ],
)
def test_due_accepts_epoch_seconds_and_rfc3339(value, expected):
    assert parse_due(value) == expected


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"id": "a", "cron": "61 * * * *"}, "cron", "bad minute field '61'"),
        ({"id": "a", "cron": "0 9 * *"}, "cron", "has 4 field(s); expected 5"),
        ({"id": "a", "cron": "0 0 30 2 *"}, "cron", "bad day-of-month field '30'"),  # February 30th
        ({"id": "a", "cron": "0 9 * * *", "tz": "Europe/Berln"}, "tz", "unknown time zone 'Europe/Berln'"),
        ({"id": "a", "every": 60, "tz": "localtime"}, "tz", "depends on the server's configuration"),
        ({"id": "a", "every": 60, "cron": "* * * * *"}, "cron", "not both"),
        ({"id": "a", "every": 0}, "every", "between 1 and"),
        ({"id": "a", "every": 1.5}, "every", "whole number of seconds, got a fraction"),
        ({"id": "a", "every": "60"}, "every", "whole number of seconds, got a string"),  # not Python's "str"
        ({"id": "a", "due": NOW, "max_lateness": [1]}, "max_lateness", "got a list"),
        ({"id": "a", "due": "9" * 310}, "due", "between 1970-01-01 and 9999-12-31"),
        ({"id": "a", "due": 10**350}, "due", "between 1970-01-01 and 9999-12-31"),
        ({"id": "a", "due": 253_402_300_799.5}, "due", "between 1970-01-01 and 9999-12-31"),  # rounds up past it
        ({"id": "a", "due": "²"}, "due", "neither epoch seconds nor an RFC 3339"),
        ({"id": "a"}, "due", "required for a one-off"),
        ({"id": "a", "due": "2026-01-05T09:00:00"}, "due", "no UTC offset"),
        ({"id": "a", "due": True}, "due", "epoch seconds or an RFC 3339"),
        ({"id": "a", "due": "tomorrow"}, "due", "neither epoch seconds nor an RFC 3339"),
        ({"id": "a", "due": NOW, "catch_up": "all"}, "catch_up", "coalesce, each, skip"),
        ({"id": "a", "due": NOW, "max_lateness": -1}, "max_lateness", "between 0 and"),
        ({"id": "a", "due": NOW, "payload": [1]}, "payload", "JSON object"),
        ({"id": "a", "due": NOW, "payload": {"x": "y" * MAX_PAYLOAD_BYTES}}, "payload", "larger than"),
        ({"id": "a b", "due": NOW}, "id", "letters, digits"),
        ({"id": "a", "due": NOW, "when": NOW}, "when", "unknown field"),
    ],
)
def test_bad_timers_are_refused_with_the_reason(body, field, reason):
    with pytest.raises(InvalidTimer) as refused:
        parse_timer("u-1", body, NOW)
    assert refused.value.field == field
    assert reason in refused.value.reason


def test_a_recurring_timer_without_due_starts_at_its_next_occurrence():
    assert parse_timer("u", {"id": "a", "cron": "0  9 * * *", "tz": "Europe/Berlin"}, NOW).due == NOW - 3600 + 86_400
    assert parse_timer("u", {"id": "a", "cron": "0 9 * * *"}, NOW).cron == "0 9 * * *"
    assert parse_timer("u", {"id": "b", "every": 300}, NOW).due == NOW + 300


@pytest.fixture
def api(stack, ledger, vigil_env, spawn):
    """A real ingest with the timers API mounted, a bearer token, and a scheduler."""
    from vigil.ingest.auth import new_token, token_hash

    token = new_token()
    query(ledger, "INSERT INTO api_tokens (id, name, token_hash) VALUES ('tok-1', 'test', %s)", (token_hash(token),))
    port = int(vigil_env["VIGIL_INGEST_PORT"])
    spawn(["ingest"], vigil_env, name="ingest").wait_healthy(port)
    env = {**vigil_env, "VIGIL_SCHEDULER_TICK_S": "0.2"}
    spawn(["scheduler"], env, name="scheduler").wait_healthy(int(env["VIGIL_SCHEDULER_PORT"]))
    with httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=10
    ) as client:
        yield client


def test_timers_api_creates_lists_cancels_and_the_scheduler_fires(api, ledger, stack, topics):
    now = int(time.time())
    digest = {"id": "digest", "cron": "0 9 * * *", "tz": "America/New_York", "payload": {"task": "daily digest"}}
    created = api.post("/v1/users/alice/timers", json=digest)
    assert created.status_code == 201, created.text
    assert created.json()["status"] == "created" and created.json()["kind"] == "schedule"
    stored_due = created.json()["due"]

    # The deploy runs its set-up again, with a due time from long ago: the stored one stands.
    again = api.post("/v1/users/alice/timers", json={**digest, "due": "2026-01-01T14:00:00Z"})
    assert again.status_code == 200 and again.json()["due"] == stored_due

    soon = api.post("/v1/users/alice/timers", json={"id": "soon", "due": now + 1, "payload": {"note": "call back"}})
    assert soon.status_code == 201
    wait_for(lambda: topic_size(stack.bootstrap, topics.events) == 1, 20, "the one-off to fire")
    (event,) = read_topic(stack.bootstrap, topics.events)
    assert (event.user_id, event.source, event.source_id, event.kind) == (
        "alice",
        "timer",
        f"soon@{now + 1}",
        "timer.followup",
    )
    assert json.loads(event.payload)["payload"] == {"note": "call back"}
    refired = api.post("/v1/users/alice/timers", json={"id": "soon", "due": now + 1})
    assert (
        refired.status_code == 200
        and refired.json()["status"] == "unchanged"
        and "already fired" in refired.json()["note"]
    )

    listed = api.get("/v1/users/alice/timers")
    assert [t["id"] for t in listed.json()["timers"]] == ["digest"]
    assert [t["id"] for t in api.get("/v1/users/alice/timers", params={"all": "true"}).json()["timers"]] == [
        "digest",
        "soon",
    ]
    assert api.get("/v1/users/alice/timers/soon").json()["fired_count"] == 1
    assert api.get("/v1/users/alice/timers", params={"limit": "1"}).json()["next_after"] == "digest"

    assert api.delete("/v1/users/alice/timers/digest").status_code == 204
    gone = api.delete("/v1/users/alice/timers/digest")
    assert gone.status_code == 404 and "not live" in gone.json()["detail"]
    assert api.delete("/v1/users/alice/timers/nope").status_code == 404
    assert query(ledger, "SELECT done, cancelled_at IS NOT NULL AS c FROM timers WHERE id = 'digest'") == [
        {"done": True, "c": True}
    ]


def test_timers_api_refuses_bad_requests_precisely(api, ledger):
    bad_cron = api.post("/v1/users/alice/timers", json={"id": "x", "cron": "0 25 * * *"})
    assert bad_cron.status_code == 400
    assert bad_cron.json()["field"] == "cron" and "bad hour field '25'" in bad_cron.json()["detail"]
    bad_zone = api.post("/v1/users/alice/timers", json={"id": "x", "cron": "0 9 * * *", "tz": "Mars/Base"})
    assert bad_zone.status_code == 400 and "unknown time zone 'Mars/Base'" in bad_zone.json()["detail"]
    assert (
        api.post("/v1/users/alice/timers", content=b"{nope", headers={"Content-Type": "application/json"}).status_code
        == 400
    )
    assert api.get("/v1/users/alice/timers", params={"limit": "0"}).status_code == 400
    anonymous = httpx.post(api.base_url.join("/v1/users/alice/timers"), json={"id": "x", "due": 1})
    assert anonymous.status_code == 401

    query(
        ledger,
        "INSERT INTO timers (id, user_id, kind, due, fixed_key) VALUES ('approval:r1', 'alice', "
        "'approval_expiry', date_trunc('second', now()) + interval '1 hour', 'r1')",
    )
    taken = api.post("/v1/users/alice/timers", json={"id": "approval:r1", "due": 1})
    assert taken.status_code == 409
    assert api.delete("/v1/users/alice/timers/approval:r1").status_code == 409
    assert query(ledger, "SELECT kind, done FROM timers WHERE id = 'approval:r1'") == [
        {"kind": "approval_expiry", "done": False}
    ]
