"""The broker stops: ingest answers 503 with Retry-After, never 2xx, and nothing it refused
shows up later; when the broker is back, requests succeed again without a restart.

Uses a broker of its own (free ports, tmp_path), never the shared one.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from ingest_support import create_token, make_request, read_events, start_ingest, stored
from support import wait_for
from vigil.bus.kafka import ensure_topics
from vigil.paths import repo_root
from vigil.settings import CommonSettings
from vigil_dev import broker, devstack

TOPIC = "broker-outage.events"
PRODUCE_TIMEOUT_S = 3.0


@pytest.fixture
def own_kafka(tmp_path):
    run_dir = Path(os.environ.get("VIGIL_DEV_RUN_DIR", repo_root() / ".run"))
    kafka = broker.KafkaServer(
        tmp_path / "kafka", devstack.free_port(), devstack.free_port(), broker.kafka_libs(run_dir / "kafka")
    )
    kafka.start()
    ensure_topics(CommonSettings(kafka_bootstrap=kafka.bootstrap), {TOPIC: 1})
    yield kafka
    kafka.stop()


@pytest.mark.slow
def test_broker_down_gives_503_and_nothing_half_stored_then_recovers(own_kafka, ledger):
    stack = type("OwnStack", (), {"bootstrap": own_kafka.bootstrap})
    topics = type("OwnTopics", (), {"events": TOPIC})
    ingest = start_ingest(stack, ledger, topics, produce_timeout_s=PRODUCE_TIMEOUT_S)
    try:
        token = create_token(ledger)["token"]
        client = httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

        def message(key: str) -> httpx.Response:
            return client.post("/v1/users/u-outage/messages", json={"text": key}, headers={"Idempotency-Key": key})

        assert message("before").status_code == 202
        approval_token = make_request(ledger, "r-outage", datetime.now(UTC) + timedelta(hours=1), user_id="u-outage")

        own_kafka.stop()
        started = time.monotonic()
        during = message("during")
        assert during.status_code == 503, during.text
        assert time.monotonic() - started < PRODUCE_TIMEOUT_S + 3
        assert during.headers["retry-after"].isdigit()
        assert during.json()["error"] == "broker_unavailable"
        batch = [
            {"user_id": "u-outage", "source": "billing", "source_id": f"b-{n}", "kind": "billing.x"} for n in range(3)
        ]
        assert client.post("/v1/events", json={"events": batch}).status_code == 503
        # The answer is committed in the ledger; only its wake-up could not be produced.
        refused_answer = httpx.post(
            f"{ingest.url}/v1/approvals/r-outage", json={"answer": "yes", "token": approval_token}
        )
        assert refused_answer.status_code == 503 and refused_answer.json()["answer"] == "yes"
        assert stored(ledger, "r-outage")["answer"] == "yes"
        # ingest stays in the Service (200) while it answers 503 itself; the body names the broker.
        wait_for(
            lambda: httpx.get(f"{ingest.url}/readyz").json()["checks"]["kafka"] is False,
            timeout=10,
            what="/readyz to report the broker down",
        )
        assert httpx.get(f"{ingest.url}/readyz").status_code == 200

        own_kafka.start()
        wait_for(lambda: message("after").status_code == 202, timeout=60, interval=0.5, what="ingest to produce again")
        retried = httpx.post(f"{ingest.url}/v1/approvals/r-outage", json={"answer": "yes", "token": approval_token})
        assert retried.status_code == 200 and retried.json()["answer"] == "yes"
        client.close()
    finally:
        ingest.stop()

    events = read_events(own_kafka.bootstrap, TOPIC, 3, partitions=1, settle=2.0)
    keys = [e.source_id for e in events]
    assert "before" in keys and "after" in keys and "r-outage" in keys
    assert "during" not in keys and not any(k.startswith("b-") for k in keys), keys
    wakes = [e for e in events if e.source == "approval"]
    assert len(wakes) == 1 and json.loads(wakes[0].payload)["answer"] == "yes"


def test_ledger_unreachable_gives_503_not_500(stack, topics):
    """A token lookup needs the ledger; with the ledger down the caller is told to retry."""
    dead_ledger = f"postgresql://vigil@127.0.0.1:{devstack.free_port()}/vigil"
    ingest = start_ingest(stack, dead_ledger, topics)
    try:
        response = httpx.post(
            f"{ingest.url}/v1/events",
            json={"user_id": "u1", "source": "billing", "source_id": "s1", "kind": "billing.x"},
            headers={"Authorization": "Bearer vgl_whatever"},
            timeout=30,
        )
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "ledger_unavailable" and response.headers["retry-after"].isdigit()
        assert httpx.get(f"{ingest.url}/healthz").status_code == 200  # alive: no crash loop
        assert httpx.get(f"{ingest.url}/readyz").json()["checks"]["database"] is False
    finally:
        ingest.stop()
