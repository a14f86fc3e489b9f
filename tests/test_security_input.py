"""Issue 16, bad input: every finding refused at the edge with a precise 4xx in the JSON
error shape, nothing produced (the topic is read after every test) and nothing stored (the
timers table too), and never a 500 or a logged traceback.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import UTC, datetime

import httpx
import pytest

from ingest_support import create_token, ledger_count, probed_ingest, read_events, start_ingest
from test_ingest_hooks import add_hook, signed
from vigil import numbers
from vigil.ingest.events_api import EventIn
from vigil.ingest.settings import IngestSettings
from vigil.settings import SettingsError, load


@pytest.fixture
def ingest(stack, ledger, topics):
    with probed_ingest(stack, ledger, topics, kafka_message_max_bytes=64 * 1024) as server:
        yield server
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == [], "a refusal produced"
    assert ledger_count(ledger, "SELECT count(*) FROM timers") == 0, "a refusal stored a timer"


@pytest.fixture
def client(ingest, ledger):
    token = create_token(ledger)["token"]
    with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        yield c


def good(**fields) -> dict:
    return {"user_id": "u1", "source": "billing", "source_id": "s1", "kind": "billing.x", "payload": {}, **fields}


# Words of Python's own errors that must never reach a client.
INTERNALS = ("int_max_str_digits", "Exceeds the limit", "invalid literal", "ValueError", "Traceback", "float(")


def neutral(detail: str) -> bool:
    """The detail names no Python internals and echoes no long number."""
    return len(detail) < 200 and not any(word in detail for word in INTERNALS) and "9" * 20 not in detail


def refused(response: httpx.Response, status: int, error: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["error"] == error and isinstance(body["detail"], str) and body["detail"], body
    return body


def raw_json(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST ``text`` as it is (json= would refuse to encode a lone surrogate)."""
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "method, path",
    [
        ("POST", "/v1/hooks/hk_%00"),
        ("POST", "/v1/approvals/apr-%00"),
        ("GET", "/v1/users/a%00/timers"),
        ("POST", "/v1/users/a%00/timers"),
        ("DELETE", "/v1/users/a%00/timers/t1"),
        ("GET", "/v1/users/a/timers?after=%00"),
        ("POST", "/v1/users/a%00/messages"),
    ],
)
def test_nul_in_a_path_or_query_is_400_before_the_ledger(client, method, path):
    """Finding: a NUL reached PostgreSQL: 500 and a 6.4 KB traceback logged twice."""
    body = refused(client.request(method, path, json={"text": "x"}), 400, "invalid_request")
    assert body["field"] in ("path", "query")


def test_lone_surrogate_in_the_second_event_refuses_the_batch(client):
    """Finding: 500 after the first event was already produced and recorded."""
    first = json.dumps(good(source_id="s1"))
    for second in (
        '{"user_id":"u1","source":"billing","source_id":"s2","kind":"k","payload":{"\\ud800":1}}',
        '{"user_id":"u1","source":"billing","source_id":"s2","kind":"k","payload":{"a":"x\\udfff"}}',
        '{"user_id":"u1","source":"billing","source_id":"s2","kind":"k","payload":["\\u0000"]}',
    ):
        body = refused(raw_json(client, "/v1/events", f'{{"events":[{first},{second}]}}'), 400, "invalid_event")
        assert body["field"].startswith("events[1].payload")


@pytest.mark.parametrize("field", ["occurred_at", "received_at"])
@pytest.mark.parametrize("instant", ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+00:01"])
def test_instant_outside_the_codecs_range_is_400(client, field, instant):
    """Finding: 202, then dead-lettered by the worker (`date value out of range`)."""
    body = refused(client.post("/v1/events", json=good(**{field: instant})), 400, "invalid_event")
    assert body["field"] == field


def test_signed_standard_webhooks_body_with_a_lone_surrogate_is_400(ingest, ledger):
    """Finding: 202, then the run failed three times and the event died."""
    hook = add_hook(ledger, "standard-webhooks")
    payload = b'{"type": "invoice.paid", "note": "\\ud800"}'
    signature = signed("standard-webhooks", hook["secret"], payload, delivery="m1")
    headers = {"Content-Type": "application/json", **signature}
    refused(httpx.post(f"{ingest.url}/v1/hooks/{hook['id']}", content=payload, headers=headers), 400, "invalid_json")


def test_stripe_created_that_is_not_unix_seconds_is_400(ingest, ledger):
    """Findings: 500 (issue 16), and ``"²"``, ``true`` or ``1.5e9`` accepted with a null instant (issue 46)."""
    hook = add_hook(ledger, "stripe")
    for created in (10**12, -1, 2**70, 10**400, "²", True, 1.5e9, 1767225600.0, "1767225600", [], {}):
        payload = json.dumps({"id": "evt_1", "type": "invoice.paid", "created": created}).encode()
        headers = {"Content-Type": "application/json", **signed("stripe", hook["secret"], payload, delivery="evt_1")}
        body = refused(
            httpx.post(f"{ingest.url}/v1/hooks/{hook['id']}", content=payload, headers=headers), 400, "invalid_request"
        )
        assert body["field"] == "created"


def test_github_form_encoded_delivery_is_415_with_a_hint(ingest, ledger):
    hook = add_hook(ledger, "github")
    response = httpx.post(
        f"{ingest.url}/v1/hooks/{hook['id']}",
        content=b"payload=%7B%7D",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert "application/json" in refused(response, 415, "unsupported_media_type")["detail"]
    assert "GitHub" in response.json()["detail"]


def test_timers_api_refuses_control_characters_nul_surrogates_and_huge_numbers(client):
    """Finding: user ids with \\n and \\x01 accepted; 500 for a NUL or lone surrogate in the
    payload; a 309-digit number echoed in an error; ``1e999`` stored as the text Infinity."""
    for user in ("a%0Ab", "a%01b"):
        timer = {"id": "t1", "due": 2_000_000_000}
        refused(client.post(f"/v1/users/{user}/timers", json=timer), 400, "invalid_request")
    for payload in ('{"x":"\\u0000"}', '{"\\ud800":1}', '{"x":"\\udc00"}'):
        text = f'{{"id":"t1","due":2000000000,"payload":{payload}}}'
        refused(raw_json(client, "/v1/users/u1/timers", text), 400, "invalid_json")
    huge = "9" * 309
    body = refused(raw_json(client, "/v1/users/u1/timers", f'{{"id":"t1","every":{huge}}}'), 400, "invalid_request")
    assert huge[:20] not in body["detail"] and len(body["detail"]) < 200
    infinite = '{"id":"t1","due":2000000000,"payload":{"x":1e999}}'
    refused(raw_json(client, "/v1/users/u1/timers", infinite), 400, "invalid_json")


def test_invalid_utf8_in_a_path_is_400_so_two_raw_ids_never_collapse(client):
    """Finding: invalid UTF-8 in a path became U+FFFD, so %FF and %FE named one user."""
    for raw in ("%FF", "%FE", "a%E9"):
        body = refused(client.post(f"/v1/users/{raw}/messages", json={"text": "hi"}), 400, "invalid_request")
        assert body["field"] == "path"


def test_non_ascii_idempotency_key_is_400(client):
    """Finding: a UTF-8 Idempotency-Key was stored as mojibake."""
    key = {b"Idempotency-Key": "clé-1".encode()}
    body = refused(client.post("/v1/users/u1/messages", json={"text": "hi"}, headers=key), 400, "invalid_request")
    assert body["field"] == "Idempotency-Key"


def test_event_that_grows_past_the_message_bound_when_encoded_is_413(client):
    """The backstop behind the body bound: a body under VIGIL_MAX_BODY_BYTES whose event is
    larger once encoded (1e5 is re-encoded as 100000.0) is refused before anything is produced."""
    numbers = ",".join(["1e5"] * 11_000)  # 44 KB of body under the 48 KiB bound; ~100 KB encoded
    text = json.dumps({"events": [good(source_id="small"), good(source_id="big", payload="P")]})
    text = text.replace('"P"', f"[{numbers}]")
    body = refused(raw_json(client, "/v1/events", text), 413, "event_too_large")
    assert body["field"] == "events[1]"


def test_body_bound_over_the_message_bound_is_a_startup_error(monkeypatch):
    """The body bound derives from the producer's message bound and is checked at start-up."""
    monkeypatch.setenv("VIGIL_APPROVAL_SECRET", "x")
    monkeypatch.setenv("VIGIL_MAX_BODY_BYTES", str(1024 * 1024))
    with pytest.raises(SettingsError, match="VIGIL_MAX_BODY_BYTES"):
        load(IngestSettings)
    monkeypatch.delenv("VIGIL_MAX_BODY_BYTES")
    settings = load(IngestSettings)
    assert settings.max_body_bytes < settings.kafka_message_max_bytes <= 1_048_588  # the broker's default


def test_client_that_disconnects_mid_body_logs_no_error(ingest, ledger):
    token = create_token(ledger, "gone")["token"]
    with socket.create_connection(("127.0.0.1", ingest.settings.ingest_port)) as sock:
        sock.sendall(
            b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + token.encode() + b"\r\nContent-Length: 5000\r\n\r\n{"
        )
        time.sleep(0.5)
    time.sleep(0.5)  # the fixture asserts nothing was logged at ERROR


# -- issue 46: numbers and instants parsed once, strictly ------------------------------

LONG = "9" * 5000


def test_timers_api_numbers_of_any_shape_are_400_naming_the_field(client):
    """Finding: ``"due"`` as a JSON integer of 350+ digits or a numeric string of 310+ digits,
    and ``?limit=`` with ``²``, ``①`` or 5,000 digits, answered 500 and logged a traceback."""
    for due in ("9" * 350, "-" + "9" * 350, f'"{"9" * 310}"', f'"{"9" * 310}.5"', '"²"', '"①"', '"١٢٣"', '"1_0"'):
        body = refused(raw_json(client, "/v1/users/u1/timers", f'{{"id":"t1","due":{due}}}'), 400, "invalid_request")
        assert body["field"] == "due" and neutral(body["detail"]), body
    for path in ("/v1/users/u1/timers", "/v1/users/u1/tasks"):
        for limit in ("²", "①", LONG, "١٢", "-1", "+5", " 5", "5 ", "1_0", "0x10", "0", "1001" * 5):
            body = refused(client.get(path, params={"limit": limit}), 400, "invalid_request")
            assert body["field"] == "limit" and neutral(body["detail"]), (path, limit, body)
    for before in ("²", "2026-01-05", "2026-01-05T09:00", "20260105T090000Z", LONG):
        body = refused(client.get("/v1/users/u1/tasks", params={"before": before}), 400, "invalid_request")
        assert body["field"] == "before" and neutral(body["detail"]), (before, body)


@pytest.mark.parametrize(
    "number",
    ["9" * 5000, "-" + "9" * 5000, "1" + "0" * 1500 + ".5", "1e-400", "-1e-400", "0." + "0" * 400 + "1", "2E-999"],
)
def test_json_number_too_long_or_too_small_is_400_in_neutral_words(client, number):
    """Findings: a 5,000-digit number's 400 named ``sys.set_int_max_str_digits``; ``1e-400``
    was stored as 0.0."""
    for path, text in (
        ("/v1/events", json.dumps(good(payload={"x": "N"}))),
        ("/v1/users/u1/timers", '{"id":"t1","due":2000000000,"payload":{"x":"N"}}'),
    ):
        body = refused(raw_json(client, path, text.replace('"N"', number)), 400, "invalid_json")
        assert body["field"] == "body" and neutral(body["detail"]), body


@pytest.mark.parametrize("field", ["occurred_at", "received_at"])
@pytest.mark.parametrize(
    "value",
    [
        253402300800,  # 10000-01-01T00:00:00Z: read as milliseconds, it was stored as 1978
        "253402300800",
        253402300799.9999999,  # rounds to 253402300800.0
        -62135596801,
        1767225600000,  # milliseconds are not seconds
        10**400,
        True,
        "²",
        "①",
        "2026-01-05T09:00:00",  # no offset
        "2026-01-05T09:00Z",  # no seconds: not RFC 3339
        "2026-01-05T09:00:00+0100",
        "2026-13-05T09:00:00Z",
        "2026-01-05T09:00:00+24:00",
        [],
    ],
)
def test_instant_that_is_not_rfc3339_or_seconds_in_range_is_400(client, field, value):
    """Finding: a bare-number ``occurred_at`` of 253402300800 was read as milliseconds and stored as 1978."""
    body = refused(client.post("/v1/events", json=good(**{field: value})), 400, "invalid_event")
    assert body["field"] == field and neutral(body["detail"]), body


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, datetime(1970, 1, 1, tzinfo=UTC)),
        (1767225600, datetime(2026, 1, 1, tzinfo=UTC)),
        ("1767225600", datetime(2026, 1, 1, tzinfo=UTC)),
        (1767225600.25, datetime(2026, 1, 1, 0, 0, 0, 250000, tzinfo=UTC)),
        (253402300799, datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)),
        (-62135596800, datetime(1, 1, 1, tzinfo=UTC)),
        ("2026-01-01T09:00:00+09:00", datetime(2026, 1, 1, tzinfo=UTC)),
        ("2026-01-01t00:00:00.123456789z", datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)),
        ("9999-12-31T23:59:59.999999Z", datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
    ],
)
def test_instant_parser_reads_a_bare_number_as_seconds(value, expected):
    assert numbers.instant(value) == expected
    assert EventIn.model_validate(good(occurred_at=value)).occurred_at == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0", 0), ("7", 7), ("007", 7), ("1000", 1000)],
)
def test_whole_number_parser_takes_ascii_digits_only(text, expected):
    assert numbers.whole_number(text, 0, 1000) == expected
    for bad in ("", "²", "①", "١", "-1", "+1", " 1", "1 ", "1_0", "1.0", "1e3", "1001", LONG):
        with pytest.raises(ValueError) as refusal:
            numbers.whole_number(bad, 0, 1000)
        assert neutral(str(refusal.value)) and "from 0 to 1000" in str(refusal.value)


def test_hook_headers_that_are_not_utf8_or_not_digits_are_400_not_500(ingest, ledger):
    """Findings: UTF-8 in GitHub's headers was stored as mojibake (see test_ingest_hooks for
    the stored text); invalid UTF-8 there is refused. And a Stripe signature stamp of
    ``t=\xb2`` (latin-1 ``²``, which ``str.isdigit`` calls a digit) was a 500."""
    github = add_hook(ledger, "github")
    payload = b'{"zen": "x"}'
    headers = {k.encode(): v.encode() for k, v in signed("github", github["secret"], payload, delivery="d1").items()}
    for name in (b"X-GitHub-Delivery", b"X-GitHub-Event"):
        bad = {**headers, b"Content-Type": b"application/json", name: b"caf\xe9-1"}
        body = refused(
            httpx.post(f"{ingest.url}/v1/hooks/{github['id']}", content=payload, headers=bad), 400, "invalid_request"
        )
        assert body["field"] == name.decode() and neutral(body["detail"]), body
    stripe = add_hook(ledger, "stripe")
    stripe_payload = json.dumps({"id": "evt_1", "type": "invoice.paid"}).encode()
    for stamp in (b"\xb2", b"\xb9\xb2", b"\xbc"):
        bad = {b"Content-Type": b"application/json", b"Stripe-Signature": b"t=" + stamp + b",v1=00"}
        response = httpx.post(f"{ingest.url}/v1/hooks/{stripe['id']}", content=stripe_payload, headers=bad)
        assert refused(response, 401, "invalid_signature")["reason"] == "malformed_header"


@pytest.mark.parametrize("field", ["occurred_at", "received_at"])
@pytest.mark.parametrize(
    "value",
    [
        "0001-01-01T00:00:00Z",
        -62135596800,  # year 1 as seconds
        "9999-12-31T23:59:59Z",
        253402300799,
        "1969-12-31T23:59:59Z",
        "ahead",  # two days past the request's arrival
    ],
)
def test_producer_set_instant_of_year_1_or_9999_is_400(client, field, value):
    """Finding: a producer-set ``received_at`` of year 1 or 9999 was accepted and ordered the
    console's timeline. Events' instants lie from 1970 to a day past their arrival."""
    if value == "ahead":
        value = int(time.time()) + 2 * 86_400
    body = refused(client.post("/v1/events", json=good(**{field: value})), 400, "invalid_event")
    assert body["field"] == field and neutral(body["detail"]), body
    batch = {"events": [good(source_id="s1"), good(source_id="s2", **{field: value})]}
    assert refused(client.post("/v1/events", json=batch), 400, "invalid_event")["field"] == f"events[1].{field}"


def test_producer_set_instants_inside_the_window_are_accepted(stack, ledger, topics):
    """1970, last year and an hour ahead (a producer's clock a little fast) still pass."""
    token = create_token(ledger)["token"]
    now = int(time.time())
    server = start_ingest(stack, ledger, topics)
    try:
        for n, value in enumerate((0, "2025-06-01T00:00:00+02:00", now + 3600)):
            response = httpx.post(
                f"{server.url}/v1/events",
                json=good(source_id=f"ok-{n}", occurred_at=value, received_at=value),
                headers={"Authorization": f"Bearer {token}"},
            )
            assert response.status_code == 202, response.text
    finally:
        server.stop()
