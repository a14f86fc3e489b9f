"""Prometheus metrics of ingest, and the ASGI middleware that counts requests.

Labels are bounded: a route *template* (``/v1/hooks/{hook_id}``, never the hook id), a
status code, a provider, an endpoint family. Never a user id, a token or a hook id.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from prometheus_client import Counter, Histogram

from vigil import logs, tracing

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
    "Requests with an unknown API token, hook id or approval id, by kind (token, hook, approval) and whether "
    "the ledger was asked (looked_up false: answered from the set of existing keys during a flood).",
    ["kind", "looked_up"],
)

_CONVERTOR = re.compile(r"\{(\w+):\w+\}")
UNMATCHED = "unmatched"  # no route: one label value for every unknown path
# Clients may send any method token; anything else is one label value, keeping it bounded.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def route_template(scope) -> str:
    """The matched route's OpenAPI template (``/v1/users/{user_id}/messages``: the path
    convertors' names left out), or ``unmatched``."""
    path = getattr(scope.get("route"), "path", None)
    return _CONVERTOR.sub(r"{\1}", path) if path else UNMATCHED


def trace_id(scope) -> str | None:
    """The trace id of a well-formed ``traceparent`` header (version-traceid-parentid-flags)."""
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            parts = value.decode("latin-1").strip().split("-")
            if len(parts) >= 4 and len(parts[1]) == 32 and parts[1] != "0" * 32:
                return parts[1].lower()
    return None


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
                if tracing.enabled:
                    # Now, not at the end: the server span ends with the response's last byte.
                    route = route_template(scope)
                    tracing.name_server_span(scope["method"] if scope["method"] in METHODS else "HTTP", route)
            await send(message)

        try:
            # The trace id names every line logged while answering the request: the server
            # span's when traces are on (it joined an incoming traceparent), else the
            # incoming traceparent's.
            with logs.context(trace_id=(tracing.enabled and tracing.current_trace_id()) or trace_id(scope)):
                await self.app(scope, receive, counting_send)
        finally:
            template = route_template(scope)
            method = scope["method"] if scope["method"] in METHODS else "OTHER"
            REQUESTS.labels(template, method, str(status[0])).inc()
            REQUEST_SECONDS.labels(template).observe(time.perf_counter() - started)


# Every bounded label value starts at zero, so increase() sees the first failure of each.
for _via in ("events", "messages", "hooks", "approvals"):
    EVENTS_PRODUCED.labels(_via)
    PRODUCE_FAILURES.labels(_via)
    PRODUCE_SECONDS.labels(_via)
for _provider in ("github", "stripe", "standard-webhooks"):
    for _reason in ("missing_header", "malformed_header", "stale_timestamp", "bad_signature", "no_active_secret"):
        SIGNATURE_FAILURES.labels(_provider, _reason)
