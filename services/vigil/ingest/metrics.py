"""Prometheus metrics of ingest, and the ASGI middleware that counts requests.

Labels are bounded: a route *template* (``/v1/hooks/{hook_id}``, never the hook id), a
status code, a provider, an endpoint family. Never a user id, a token or a hook id.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "vigil_ingest_requests_total",
    "HTTP requests answered by ingest, by route template, method and status.",
    ["route", "method", "status"],
)
REQUEST_SECONDS = Histogram(
    "vigil_ingest_request_duration_seconds",
    "Time from a request's arrival to its response, by route template.",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SIGNATURE_FAILURES = Counter(
    "vigil_webhook_signature_failures_total",
    "Webhook deliveries refused because their signature did not verify, by provider and reason.",
    ["provider", "reason"],
)
EVENTS_PRODUCED = Counter(
    "vigil_ingest_events_produced_total",
    "Events the broker acknowledged, by the endpoint family that received them.",
    ["via"],
)
PRODUCE_FAILURES = Counter(
    "vigil_ingest_produce_failures_total",
    "Produce calls that ended without the broker's acknowledgement (the caller got 503).",
    ["via"],
)
PRODUCE_SECONDS = Histogram(
    "vigil_ingest_produce_duration_seconds",
    "Time from handing events to the producer until the broker acknowledged all of them.",
    ["via"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

UNKNOWN_KEYS = Counter(
    "vigil_ingest_unknown_keys_total",
    "Requests with an unknown API token or hook id, by kind (token, hook) and whether the ledger was asked "
    "(looked_up false: answered from the set of existing keys during a flood).",
    ["kind", "looked_up"],
)

UNMATCHED = "unmatched"  # no route: one label value for every unknown path
# Clients may send any method token; anything else is one label value, keeping it bounded.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class RequestMetrics:
    """Pure ASGI middleware: stamps the arrival time, then counts the response.

    The stamp is taken before routing or reading the body, so it is the time the request
    *arrived*: the approval path checks the deadline against it.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["vigil.received_at"] = datetime.now(UTC)
        started = time.perf_counter()
        status = [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED
            method = scope["method"] if scope["method"] in METHODS else "OTHER"
            REQUESTS.labels(template, method, str(status[0])).inc()
            REQUEST_SECONDS.labels(template).observe(time.perf_counter() - started)
