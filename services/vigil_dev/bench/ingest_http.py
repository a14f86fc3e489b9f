"""``ingest_http_events_per_s``: ``POST /v1/events`` on a real ``vigil ingest`` process, next to a
trivial endpoint of the same server.

One ``python -m vigil ingest`` with a bearer token made by ``vigil tokens create NAME --json``.
Each round drives three modes back to back with 64 keep-alive connections
(:mod:`vigil_dev.bench.httpload`): ``GET /healthz`` (the trivial endpoint: same uvicorn, same
middleware, a constant answer), single-event ``POST /v1/events`` and batched ones. Every
answer counted is a 202, i.e. every event was acknowledged by the broker (``acks=all``).
The ratio is computed per round (the modes ran seconds apart, so a noisy neighbour hits
them alike) and its median printed.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

from vigil_dev.bench import httpload
from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.procs import Service, base_env
from vigil_dev.bench.stack import BenchStack
from vigil_dev.devstack import free_port

HOST = "127.0.0.1"
# Per mode, before the measured rounds: long enough for a broker the bench has just started
# to compile its produce path (with 0.5 s the first single-event round ran at half the rate
# of the later ones), short next to the rounds.
WARM_UP_S = 2.0
USERS = 1000


def _token(env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "vigil", "tokens", "create", "bench", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return json.loads(out)["token"]


def _envelope(n: int) -> dict:
    return {
        "user_id": f"u{n % USERS:05d}",
        "source": "bench",
        "source_id": f"http-{n}",
        "kind": "chat.message",
        "payload": {"text": f"bench message, about as long as a short chat line: status? #{n}"},
    }


def _modes(port: int, token: str, batch: int) -> dict:
    host = f"{HOST}:{port}"
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    trivial = httpload.request_bytes("GET", "/healthz", host, {})
    counter = itertools.count()

    def single() -> bytes:
        return httpload.request_bytes("POST", "/v1/events", host, auth, json.dumps(_envelope(next(counter))).encode())

    def batched() -> bytes:
        events = [_envelope(next(counter)) for _ in range(batch)]
        return httpload.request_bytes("POST", "/v1/events", host, auth, json.dumps({"events": events}).encode())

    return {"trivial": (lambda: trivial, 1), "single": (single, 1), "batched": (batched, batch)}


def ingest_http(stack: BenchStack, plan: Plan, report: Report) -> None:
    names = [
        "trivial_http_requests_per_s",
        "ingest_http_events_per_s",
        "ingest_http_batched_events_per_s",
        "ingest_http_ratio",
        "ingest_http_batched_ratio",
    ]
    try:
        from vigil.ingest.app import create_app  # noqa: F401  (is ingest there at all?)
    except ImportError as exc:
        for name in names:
            report.add(Figure(name, pending=f"ingest not available: {exc}"))
        return
    with stack.ledger() as dsn, stack.topics(plan.partitions) as topics:
        port = free_port()
        env = base_env(stack, dsn, topics)
        # No per-token rate limit: the figure is what ingest carries, not the limit's policy
        # (5,000 requests/s and its burst capped the single-event rounds at 7,500/s, 429s).
        env.update({"VIGIL_INGEST_PORT": str(port), "VIGIL_INGEST_HOST": HOST, "VIGIL_INGEST_TOKEN_RATE": "0"})
        token = _token(env)
        service = Service("ingest", ["ingest"], env, port, stack.workdir / "ingest.log").start()
        try:
            service.wait_healthy()
            deadline = time.monotonic() + 60
            # ingest's /readyz is 200 while it serves; its checks say when broker and ledger answer.
            while not all(json.loads(service.get("/readyz") or '{"checks": {"x": false}}')["checks"].values()):
                service.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ingest not ready:\n{service.log()[-2000:]}")
                time.sleep(0.2)
            modes = _modes(port, token, plan.http_batch)
            for make, _ in modes.values():
                httpload.run(HOST, port, plan.http_concurrency, WARM_UP_S, make)
            rates: dict[str, list[float]] = {name: [] for name in modes}
            refused = 0
            for _ in range(plan.rounds):
                for name, (make, events) in modes.items():
                    result = httpload.run(HOST, port, plan.http_concurrency, plan.http_seconds, make)
                    service.check()
                    refused += result.refused
                    rates[name].append(result.ok_per_s * events)
        finally:
            service.stop()
    conc = f"concurrency {plan.http_concurrency}"
    refusals = f", {refused} non-2xx answers" if refused else ""
    report.add(Figure("trivial_http_requests_per_s", rates["trivial"], note=f"GET /healthz, {conc}"))
    report.add(
        Figure("ingest_http_events_per_s", rates["single"], note=f"1 event per POST /v1/events, {conc}{refusals}")
    )
    report.add(
        Figure(
            "ingest_http_batched_events_per_s",
            rates["batched"],
            note=f"{plan.http_batch} events per POST /v1/events, {conc}",
        )
    )
    report.add(
        Figure(
            "ingest_http_ratio",
            [s / t for s, t in zip(rates["single"], rates["trivial"])],
            note="single-event requests/s over trivial requests/s, per round",
        )
    )
    report.add(
        Figure(
            "ingest_http_batched_ratio",
            [b / t for b, t in zip(rates["batched"], rates["trivial"])],
            note="batched events/s over trivial requests/s, per round",
        )
    )
