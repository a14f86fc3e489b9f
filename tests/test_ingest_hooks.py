"""Webhooks, per provider, against signatures computed here from each provider's documented
scheme (never by calling vigil's verifier): valid, rotated, tampered, stale, unsigned.

- GitHub: ``X-Hub-Signature-256: sha256=`` + hex HMAC-SHA256(secret, body).
- Stripe: ``Stripe-Signature: t=<ts>,v1=`` + hex HMAC-SHA256(secret, "<ts>.<body>").
- Standard Webhooks: ``webhook-signature: v1,`` + base64 HMAC-SHA256(base64decode(secret
  without "whsec_"), "<id>.<ts>.<body>").
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid

import httpx
import pytest

from ingest_support import cli, probed_ingest, read_events
from support import wait_for

STRIPE_ISSUED = "whsec_" + "s" * 32  # Stripe issues the secret; the operator pastes it in


@pytest.fixture
def ingest(stack, ledger, topics):
    with probed_ingest(stack, ledger, topics, ingest_auth_cache_s=1.0) as server:
        yield server


def hex_hmac(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signed(provider: str, secret: str, body: bytes, *, delivery: str, at: int | None = None) -> dict[str, str]:
    at = int(time.time()) if at is None else at
    if provider == "github":
        return {
            "X-Hub-Signature-256": "sha256=" + hex_hmac(secret.encode(), body),
            "X-GitHub-Delivery": delivery,
            "X-GitHub-Event": "push",
        }
    if provider == "stripe":
        return {"Stripe-Signature": f"t={at},v1={hex_hmac(secret.encode(), f'{at}.'.encode() + body)}"}
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{delivery}.{at}.".encode() + body, hashlib.sha256).digest()
    return {
        "webhook-id": delivery,
        "webhook-timestamp": str(at),
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }


def body_for(provider: str, delivery: str) -> bytes:
    if provider == "stripe":
        document = {"id": delivery, "type": "invoice.paid", "created": 1767225600, "data": {"object": {"amount": 1200}}}
    else:
        document = {"type": "invoice.paid", "ref": "refs/heads/main", "note": "日本語 ✓"}
    # Deliberately not re-serialisable byte for byte: odd spacing must still verify.
    return json.dumps(document, ensure_ascii=False, indent=3).encode()


def add_hook(ledger: str, provider: str) -> dict:
    if provider == "stripe":
        created = json.loads(
            cli(
                ledger,
                "hooks",
                "add",
                "--provider",
                provider,
                "--user",
                "u-hooks",
                "--secret-stdin",
                "--json",
                input=STRIPE_ISSUED + "\n",
            )
        )
        return {**created, "secret": STRIPE_ISSUED}
    created = json.loads(cli(ledger, "hooks", "add", "--provider", provider, "--user", "u-hooks", "--json"))
    if provider == "standard-webhooks":
        assert created["secret"].startswith("whsec_") and len(base64.b64decode(created["secret"][6:])) >= 24
    return created


def post(ingest, hook: dict, body: bytes, headers: dict) -> httpx.Response:
    return httpx.post(
        f"{ingest.url}/v1/hooks/{hook['id']}", content=body, headers={"Content-Type": "application/json", **headers}
    )


def refusal_reason(response: httpx.Response) -> str:
    assert response.status_code == 401, response.text
    assert response.json()["error"] == "invalid_signature"
    return response.json()["reason"]


PROVIDERS = ["github", "stripe", "standard-webhooks"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_valid_delivery_is_produced_with_the_provider_keys(ingest, ledger, stack, topics, provider):
    hook = add_hook(ledger, provider)
    delivery = f"evt_{uuid.uuid4().hex}"
    body = body_for(provider, delivery)
    response = post(ingest, hook, body, signed(provider, hook["secret"], body, delivery=delivery))
    assert response.status_code == 202, response.text
    [event] = read_events(stack.bootstrap, topics.events, 1, topics.partitions)
    assert (event.user_id, event.source, event.source_id) == ("u-hooks", provider, delivery)
    assert event.kind == (f"{provider}.push" if provider == "github" else f"{provider}.invoice.paid")
    assert event.payload.encode() == body  # as received, byte for byte


@pytest.mark.parametrize("provider", PROVIDERS)
def test_tampered_missing_and_stale_are_401_and_produce_nothing(ingest, ledger, stack, topics, provider):
    hook = add_hook(ledger, provider)
    delivery = f"evt_{uuid.uuid4().hex}"
    body = body_for(provider, delivery)
    headers = signed(provider, hook["secret"], body, delivery=delivery)
    tampered = body.replace(b"1200", b"9999") if provider == "stripe" else body.replace(b"main", b"evil")
    assert tampered != body
    assert refusal_reason(post(ingest, hook, tampered, headers)) == "bad_signature"
    signature_header = {
        "github": "X-Hub-Signature-256",
        "stripe": "Stripe-Signature",
        "standard-webhooks": "webhook-signature",
    }[provider]
    unsigned = {k: v for k, v in headers.items() if k != signature_header}
    assert refusal_reason(post(ingest, hook, body, unsigned)) == "missing_header"
    wrong_secret = signed(provider, "whsec_" + base64.b64encode(b"k" * 32).decode(), body, delivery=delivery)
    assert refusal_reason(post(ingest, hook, body, wrong_secret)) == "bad_signature"
    if provider != "github":  # GitHub signs no timestamp (its replays are caught by the dedup key)
        stale = signed(provider, hook["secret"], body, delivery=delivery, at=int(time.time()) - 301)
        assert refusal_reason(post(ingest, hook, body, stale)) == "stale_timestamp"
        # Well past the tolerance: time passing between signing and checking shrinks a future
        # timestamp's distance (on a loaded machine +301 became 300 and was rightly accepted).
        future = signed(provider, hook["secret"], body, delivery=delivery, at=int(time.time()) + 330)
        assert refusal_reason(post(ingest, hook, body, future)) == "stale_timestamp"
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []
    metrics = httpx.get(f"{ingest.url}/metrics").text
    assert f'vigil_webhook_signature_failures_total{{provider="{provider}",reason="bad_signature"}}' in metrics


@pytest.mark.parametrize("provider", PROVIDERS)
def test_rotation_keeps_both_secrets_valid_until_the_old_one_is_revoked(ingest, ledger, stack, topics, provider):
    hook = add_hook(ledger, provider)
    secret_input = "whsec_" + "r" * 40 + "\n" if provider == "stripe" else None
    args = ["hooks", "rotate", hook["id"], "--json"] + (["--secret-stdin"] if secret_input else [])
    rotated = json.loads(cli(ledger, *args, input=secret_input))
    new_secret = rotated.get("secret") or secret_input.strip()
    assert rotated["secret_id"] != hook["secret_id"] and new_secret != hook["secret"]

    def deliver(secret: str) -> httpx.Response:
        delivery = f"evt_{uuid.uuid4().hex}"
        body = body_for(provider, delivery)
        return post(ingest, hook, body, signed(provider, secret, body, delivery=delivery))

    # The old secret was cached by the first delivery; the new one works at once anyway.
    assert deliver(hook["secret"]).status_code == 202
    assert deliver(new_secret).status_code == 202
    assert deliver(hook["secret"]).status_code == 202
    cli(ledger, "hooks", "revoke-secret", hook["id"], str(hook["secret_id"]))
    wait_for(lambda: deliver(hook["secret"]).status_code == 401, timeout=10, what="the revoked secret to be refused")
    assert deliver(new_secret).status_code == 202
    assert len(read_events(stack.bootstrap, topics.events, 4, topics.partitions)) >= 4
    listed = cli(ledger, "hooks", "list")
    assert hook["id"] in listed and hook["secret"] not in listed and new_secret not in listed


def test_github_ping_is_verified_but_wakes_nobody(ingest, ledger, stack, topics):
    hook = add_hook(ledger, "github")
    body = b'{"zen": "Keep it logically awesome.", "hook_id": 1}'
    headers = {**signed("github", hook["secret"], body, delivery="ping-1"), "X-GitHub-Event": "ping"}
    response = post(ingest, hook, body, headers)
    assert response.status_code == 200 and response.json()["accepted"] == 0
    forged = {**headers, "X-Hub-Signature-256": "sha256=" + "0" * 64}
    assert refusal_reason(post(ingest, hook, body, forged)) == "bad_signature"
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []


@pytest.mark.parametrize("provider", ["github", "standard-webhooks"])
def test_utf8_in_delivery_headers_is_stored_as_the_text_sent(ingest, ledger, stack, topics, provider):
    """Issue 46 finding: ``X-GitHub-Delivery: café-1`` (UTF-8) was stored as ``cafÃ©-1``:
    header bytes were read as latin-1. They are decoded as UTF-8 (or refused, see
    test_security_input), so the delivery id is the one the provider sent."""
    hook = add_hook(ledger, provider)
    body = body_for(provider, "café-1")
    headers = {k.encode(): v.encode() for k, v in signed(provider, hook["secret"], body, delivery="café-1").items()}
    if provider == "github":
        headers[b"X-GitHub-Event"] = "pull_request_révision".encode()
    response = httpx.post(
        f"{ingest.url}/v1/hooks/{hook['id']}", content=body, headers={b"Content-Type": b"application/json", **headers}
    )
    assert response.status_code == 202, response.text
    assert response.json()["source_id"] == "café-1"
    [event] = read_events(stack.bootstrap, topics.events, 1, topics.partitions)
    assert event.source_id == "café-1"
    if provider == "github":
        assert event.kind == "github.pull_request_révision"


def test_the_last_secret_is_not_revoked_without_force(ledger):
    from click.testing import CliRunner

    from vigil.cli import main

    hook = add_hook(ledger, "github")
    result = CliRunner().invoke(
        main, ["hooks", "revoke-secret", hook["id"], str(hook["secret_id"])], env={"VIGIL_DATABASE_URL": ledger}
    )
    assert result.exit_code != 0 and "last active" in result.output
    cli(ledger, "hooks", "revoke-secret", hook["id"], str(hook["secret_id"]), "--force")


def test_unknown_and_oversized_hook_ids_are_404(ingest):
    for hook_id in ("hk_missing", "x" * 300):
        response = httpx.post(f"{ingest.url}/v1/hooks/{hook_id}", json={"id": "evt"})
        assert response.status_code == 404 and response.json()["error"] == "unknown_hook"


def test_a_stripe_delivery_with_created_null_is_refused_and_produces_nothing(ingest, ledger, stack, topics):
    # Issue 58: "created": null was stored as an event with no time.
    hook = add_hook(ledger, "stripe")
    body = json.dumps({"id": "evt_null", "type": "invoice.paid", "created": None}).encode()
    response = post(ingest, hook, body, signed("stripe", hook["secret"], body, delivery="evt_null"))
    assert response.status_code == 400 and response.json()["field"] == "created", response.text
    assert read_events(stack.bootstrap, topics.events, 0, topics.partitions, settle=1.0) == []
