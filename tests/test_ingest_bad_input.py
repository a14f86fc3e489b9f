"""The issue's bad-input list, one test per line: each refusal is a precise status with
``{"error": code, "detail": ...}``, and nothing reaches the topic (checked after every test).

(Signatures: test_ingest_hooks.py. Tokens: test_ingest_events.py. Broker down:
test_ingest_broker.py.)
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from ingest_support import create_token, read_events, start_ingest

LIMIT = 4096  # VIGIL_MAX_BODY_BYTES for these tests


@pytest.fixture
def ingest(stack, ledger, topics):
    server = start_ingest(stack, ledger, topics, max_body_bytes=LIMIT, ingest_max_batch=5)
    yield server
    server.stop()
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == [], (
        "a refused request produced"
    )


@pytest.fixture
def client(ingest, ledger):
    token = create_token(ledger)["token"]
    with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        c.token = token
        yield c


def good(**fields) -> dict:
    return {"user_id": "u1", "source": "billing", "source_id": "s1", "kind": "billing.x", "payload": {}, **fields}


def refused(response: httpx.Response, status: int, error: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["error"] == error and isinstance(body["detail"], str) and body["detail"]
    return body


def test_malformed_json_is_400(client):
    headers = {"Content-Type": "application/json"}
    refused(client.post("/v1/events", content=b'{"user_id": "u1", ', headers=headers), 400, "invalid_json")
    refused(client.post("/v1/events", content=b"", headers=headers), 400, "invalid_json")
    refused(client.post("/v1/events", content='{"a": NaN}', headers=headers), 400, "invalid_json")
    refused(client.post("/v1/events", content="{}".encode("utf-16"), headers=headers), 400, "invalid_json")


@pytest.mark.parametrize(
    "body, field",
    [
        ({k: v for k, v in good().items() if k != "kind"}, "kind"),
        (good(user_id=""), "user_id"),
        (good(user_id=7), "user_id"),
        (good(source_id="a\x00b"), "source_id"),
        (good(occured_at="2026-01-01T00:00:00Z"), "occured_at"),  # a typo is not silently dropped
        (good(occurred_at="2026-01-01T00:00:00"), "occurred_at"),  # no offset: ambiguous instant
        ({"events": [good(), good(source_id="")]}, "events[1].source_id"),
        ({"events": []}, "events"),
        ({"events": [good()] * 6}, "events"),  # over VIGIL_INGEST_MAX_BATCH
        ([good()], "body"),
    ],
)
def test_envelope_validation_is_400_naming_the_field(client, body, field):
    assert refused(client.post("/v1/events", json=body), 400, "invalid_event")["field"] == field


def test_message_validation_is_400_naming_the_field(client):
    assert refused(client.post("/v1/users/u1/messages", json={"txt": "hi"}), 400, "invalid_event")["field"] in (
        "text",
        "txt",
    )
    assert refused(client.post("/v1/users/u1/messages", json={"text": ""}), 400, "invalid_event")["field"] == "text"
    key = {b"Idempotency-Key": b"k\xa0"}  # valid HTTP (obs-text), not a printable key
    assert (
        refused(client.post("/v1/users/u1/messages", json={"text": "hi"}, headers=key), 400, "invalid_request")["field"]
        == "Idempotency-Key"
    )


def test_unknown_hook_is_404(ingest):
    response = httpx.post(f"{ingest.url}/v1/hooks/hk_nope", json={}, headers={"X-Hub-Signature-256": "sha256=00"})
    refused(response, 404, "unknown_hook")


def test_unknown_route_and_method_are_json(client):
    refused(client.get("/v1/nothing-here"), 404, "not_found")
    refused(client.get("/v1/events"), 405, "method_not_allowed")


def _raw_request(port: int, head: str, body_part: bytes) -> tuple[bytes, float]:
    """Send a request head and part of a body, never the rest; the response and its delay."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + body_part)
        started = time.monotonic()
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
        return response, time.monotonic() - started


def test_declared_body_over_the_limit_is_413_before_it_is_read(ingest, client):
    head = (
        "POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {client.token}\r\nContent-Length: {50 * 1024 * 1024}\r\n\r\n"
    )
    # 50 MiB declared, 1 KiB sent: an answer now proves the server did not wait for the rest.
    response, waited = _raw_request(ingest.settings.ingest_port, head, b"{" + b" " * 1023)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b'"error":"body_too_large"' in response and waited < 5


def test_chunked_body_over_the_limit_is_413_while_streaming(ingest, client):
    head = (
        "POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {client.token}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    part = b" " * 1024
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for _ in range(LIMIT // len(part) + 2))
    # The closing zero-length chunk is never sent: the body has no declared end.
    response, _ = _raw_request(ingest.settings.ingest_port, head, chunks)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]


def test_wrong_content_type_is_415(client, ingest):
    refused(
        client.post("/v1/events", content=b"user_id=u1", headers={"Content-Type": "application/x-www-form-urlencoded"}),
        415,
        "unsupported_media_type",
    )
    refused(
        client.post("/v1/events", content=b"{}", headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type"
    )
    refused(
        client.post("/v1/users/u1/messages", content=b'{"text": "x"}', headers={"Content-Type": ""}),
        415,
        "unsupported_media_type",
    )
    gzipped = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    refused(client.post("/v1/events", content=b"\x1f\x8b\x08\x00", headers=gzipped), 415, "unsupported_media_type")
    refused(
        httpx.post(f"{ingest.url}/v1/approvals/r1", content=b"answer=yes", headers={"Content-Type": "text/plain"}),
        415,
        "unsupported_media_type",
    )


def test_very_long_header_values_are_refused_cleanly(client, ingest):
    long_key = {"Idempotency-Key": "k" * 8000}
    assert (
        refused(client.post("/v1/users/u1/messages", json={"text": "hi"}, headers=long_key), 400, "invalid_request")[
            "field"
        ]
        == "Idempotency-Key"
    )
    long_token = {"Authorization": "Bearer " + "t" * 600}
    refused(httpx.post(f"{ingest.url}/v1/events", json=good(), headers=long_token), 401, "unauthorized")
    signature = {"X-Hub-Signature-256": "sha256=" + "0" * 6_000}
    refused(httpx.post(f"{ingest.url}/v1/hooks/{'h' * 5000}", json={}, headers=signature), 404, "unknown_hook")
    # Past VIGIL_INGEST_MAX_HEADER_BYTES (16 KiB) the server refuses the head itself (issue 16).
    huge_token = {"Authorization": "Bearer " + "t" * 60_000}
    refused(httpx.post(f"{ingest.url}/v1/events", json=good(), headers=huge_token), 431, "headers_too_large")
    huge_signature = {"X-Hub-Signature-256": "sha256=" + "0" * 60_000}
    refused(httpx.post(f"{ingest.url}/v1/hooks/hk_x", json={}, headers=huge_signature), 431, "headers_too_large")
    # And the server still serves.
    assert httpx.get(f"{ingest.url}/healthz").status_code == 200
