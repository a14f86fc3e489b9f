"""`vigil ingest` as a real process: end to end through the worker, SIGKILL mid-stream,
secrets kept out of its log, the OpenAPI contract, start-up refusals, metrics."""

from __future__ import annotations

import hashlib
import hmac
import json
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from ingest_support import cli, create_token, make_request, start_ingest
from support import scalar, wait_for
from vigil.ingest import openapi
from worker_support import FAST, metric


def start(spawn, vigil_env, name: str = "ingest", **extra: str):
    env = {**vigil_env, **extra}
    return spawn(["ingest"], env, name=name).wait_healthy(int(env["VIGIL_INGEST_PORT"]))


def github_delivery(secret: str, delivery: str) -> tuple[bytes, dict]:
    body = json.dumps({"ref": "refs/heads/main", "commits": [{"message": "fix"}]}).encode()
    return body, {
        "Content-Type": "application/json",
        "X-Hub-Signature-256": "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(),
        "X-GitHub-Delivery": delivery,
        "X-GitHub-Event": "push",
    }


@pytest.mark.slow
def test_a_delivery_retried_three_times_gives_one_ledger_row(spawn, vigil_env, ledger):
    """Through the worker. The first ingest is SIGKILLed after the first delivery (as in a
    machine loss); the provider's retries go to its replacement."""
    worker = spawn(["worker"], {**vigil_env, **FAST, "VIGIL_AGENT": "echo"}, name="worker")
    worker.wait_healthy(int(vigil_env["VIGIL_WORKER_PORT"]))
    ingest = start(spawn, vigil_env, "ingest-1")
    url = f"http://127.0.0.1:{vigil_env['VIGIL_INGEST_PORT']}"
    hook = json.loads(cli(ledger, "hooks", "add", "--provider", "github", "--user", "u-e2e", "--json"))
    body, headers = github_delivery(hook["secret"], "gh-delivery-e2e")

    assert httpx.post(f"{url}/v1/hooks/{hook['id']}", content=body, headers=headers).status_code == 202
    ingest.kill()
    start(spawn, vigil_env, "ingest-2")
    for _ in range(2):  # the provider saw no answer and retries, twice
        assert httpx.post(f"{url}/v1/hooks/{hook['id']}", content=body, headers=headers).status_code == 202

    worker_port = int(vigil_env["VIGIL_WORKER_PORT"])
    wait_for(
        lambda: metric(worker_port, "vigil_events_recorded_total", 'result="duplicate"') >= 2,
        60,
        "both retries seen by the worker",
    )
    wait_for(
        lambda: scalar(ledger, "SELECT status FROM events WHERE source_id = 'gh-delivery-e2e'") == "done",
        60,
        "the delivery's run",
    )
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source = 'github' AND source_id = 'gh-delivery-e2e'") == 1
    assert scalar(ledger, "SELECT kind FROM events WHERE source_id = 'gh-delivery-e2e'") == "github.push"
    assert scalar(ledger, "SELECT count(*) FROM runs WHERE user_id = 'u-e2e'") == 1


@pytest.mark.slow
def test_secrets_and_tokens_never_reach_the_log(spawn, vigil_env, ledger):
    ingest = start(spawn, vigil_env, VIGIL_LOG_LEVEL="DEBUG")
    url = f"http://127.0.0.1:{vigil_env['VIGIL_INGEST_PORT']}"
    token = create_token(ledger)["token"]
    bad_token = "vgl_" + uuid.uuid4().hex + "-wrong"
    hook = json.loads(cli(ledger, "hooks", "add", "--provider", "github", "--user", "u-logs", "--json"))
    body, headers = github_delivery(hook["secret"], "gh-logs-1")
    approval_token = make_request(ledger, "r-logs", datetime.now(UTC) + timedelta(hours=1), user_id="u-logs")

    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.post(f"{url}/v1/users/u-logs/messages", json={"text": "hi"}, headers=auth).status_code == 202
    assert httpx.post(f"{url}/v1/events", json={}, headers={"Authorization": f"Bearer {bad_token}"}).status_code == 401
    assert httpx.post(f"{url}/v1/hooks/{hook['id']}", content=body, headers=headers).status_code == 202
    forged = {**headers, "X-Hub-Signature-256": "sha256=" + "ab" * 32}
    assert httpx.post(f"{url}/v1/hooks/{hook['id']}", content=body, headers=forged).status_code == 401
    assert httpx.post(f"{url}/v1/approvals/r-logs", json={"answer": "yes", "token": approval_token}).status_code == 200
    assert (
        httpx.post(f"{url}/v1/approvals/r-logs", json={"answer": "no", "token": approval_token + "x"}).status_code
        == 403
    )
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status tells why.
    assert ingest.stop() in (0, -signal.SIGTERM)

    log = ingest.log()
    assert "refused with 401" in log and "approval r-logs" in log, "the DEBUG log was not written at all"
    assert "ingest stopped" in log
    for secret in (
        token,
        bad_token,
        hook["secret"],
        approval_token,
        headers["X-Hub-Signature-256"][7:],
        vigil_env["VIGIL_APPROVAL_SECRET"],
    ):
        assert secret not in log


def test_served_openapi_is_the_committed_one(stack, ledger, topics):
    server = start_ingest(stack, ledger, topics)
    try:
        served = httpx.get(f"{server.url}/openapi.json").json()
    finally:
        server.stop()
    committed = json.loads(openapi.COMMITTED.read_text())
    assert served == committed, "openapi.json is stale: run `python -m vigil.ingest.openapi --write` and commit it"
    assert {"/v1/events", "/v1/users/{user_id}/messages", "/v1/hooks/{hook_id}", "/v1/approvals/{request_id}"} <= set(
        served["paths"]
    )


def test_ingest_refuses_to_start_without_an_approval_secret(vigil_env):
    env = {k: v for k, v in vigil_env.items() if k != "VIGIL_APPROVAL_SECRET"}
    result = subprocess.run(
        [sys.executable, "-m", "vigil", "ingest"],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "VIGIL_APPROVAL_SECRET" in result.stderr


def test_metrics_count_requests_by_route_template_and_produce_latency(stack, ledger, topics):
    server = start_ingest(stack, ledger, topics)
    try:
        token = create_token(ledger)["token"]
        auth = {"Authorization": f"Bearer {token}"}
        for user in ("u-a", "u-b"):
            assert (
                httpx.post(f"{server.url}/v1/users/{user}/messages", json={"text": "x"}, headers=auth).status_code
                == 202
            )
        httpx.post(f"{server.url}/v1/users/u-a/messages", json={"text": "x"})
        httpx.get(f"{server.url}/no/such/path")
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    # One series per route template, whatever the user: no user id in any label.
    assert 'vigil_ingest_requests_total{method="POST",route="/v1/users/{user_id}/messages",status="202"}' in text
    assert 'route="/v1/users/{user_id}/messages",status="401"' in text
    assert 'route="unmatched",status="404"' in text
    assert "u-a" not in text and "u-b" not in text
    assert 'vigil_ingest_events_produced_total{via="messages"}' in text
    assert 'vigil_ingest_produce_duration_seconds_bucket{le="0.005",via="messages"}' in text
    assert "vigil_webhook_signature_failures_total" in text
