"""Traces: OpenTelemetry spans from the ingest request to the dispatcher's delivery.

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set:
then :func:`setup` installs the SDK with a batching OTLP/HTTP exporter and the instrumentations
(psycopg, httpx, the model client's aiohttp), and every other standard ``OTEL_*`` variable
applies (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_EXPORTER_OTLP_HEADERS``, ...). Off, nothing is installed:
every helper here checks :data:`enabled` first and returns at once, and the services' own code
calls them only behind that check where a call would sit on a hot path.

How one event's trace is carried (docs/operations.md, "Traces"):

- ingest's server span joins an incoming ``traceparent``; the produce is a span under it, and
  its context goes into the event's envelope ``headers`` (which the ledger stores with the
  event) and onto the Kafka record's headers (``traceparent``, ``tracestate``);
- the worker's record span continues it (from the envelope, else from the record's headers)
  and writes its own context into the headers it stores; the run's span is a child of its
  first event's stored context and links to the others'; each conversation of the run is an
  ``invoke_agent`` span under it, with the model calls (the SDK's own spans, and aiohttp's
  per attempt) and tool calls as its children; ledger statements are the run's children;
  the finish is a span under the run;
- the run's context is stored on its outbox rows and timers (``traceparent`` columns): the
  dispatcher's delivery span continues it, and so does the scheduler's fire span of a
  one-off timer the run set (a follow-up belongs to the conversation that asked for it). A
  timer with no stored context, or a recurring one, starts a trace per occurrence, linked to
  the stored context if there is one.

Outgoing calls with no traced cause around them (the dispatcher's and the scheduler's polls,
the claim pass's statements) would be a trace each every few milliseconds: the sampler drops
root spans of kind ``CLIENT``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from vigil import logs
from vigil.ledger.db import statement_names

log = logging.getLogger(__name__)

# True once setup() installed the SDK. Read on hot paths as ``tracing.enabled``.
enabled = False
_tracer: trace.Tracer = trace.get_tracer("vigil")

TRACE_HEADERS = ("traceparent", "tracestate")
# ingest's probes and scrapes are not requests anyone traces (a span each, every few seconds).
EXCLUDED_URLS = "/healthz,/readyz,/metrics"

T = TypeVar("T")


def endpoint_configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(service: str) -> bool:
    """Install the SDK for ``service`` (``vigil-<service>`` unless ``OTEL_SERVICE_NAME`` says
    otherwise) if an OTLP endpoint is configured. Returns whether traces are on.

    The provider flushes its last batch at exit (the SDK's atexit hook), so a service stopped
    with SIGTERM still exports the spans of what it finished.
    """
    global enabled, _tracer
    if enabled or not endpoint_configured() or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return enabled
    # Imported here on purpose, as in the other functions that only run with traces on: the
    # SDK, the exporter and the instrumentations take about a third of a second to import, and
    # a deployment without an OTLP endpoint never needs them.
    from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.sdk.resources import SERVICE_NAME

    provider = exporting_provider(service)
    trace.set_tracer_provider(provider)
    _name_statements_after_queries()
    PsycopgInstrumentor().instrument()
    HTTPXClientInstrumentor().instrument()
    AioHttpClientInstrumentor().instrument()
    _tracer = trace.get_tracer("vigil")
    enabled = True
    log.info("traces exported over OTLP/HTTP as %s", provider.resource.attributes[SERVICE_NAME])
    return True


def exporting_provider(service: str):
    """The SDK's tracer provider :func:`setup` installs, not installed: ``vigil-<service>`` (or
    ``OTEL_SERVICE_NAME``), the sampler, and a batching OTLP/HTTP exporter to the endpoint the
    ``OTEL_EXPORTER_OTLP_*`` variables name. Apart from setup() so that a test can export
    in-process spans exactly as a service does, without the process-wide instrumentations."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # late: see setup()
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"vigil-{service}"}
    # The sampler OTEL_TRACES_SAMPLER names (parent-based always-on by default), behind the
    # rule that drops causeless outgoing calls.
    sampler = CausedOnly(_get_from_env_or_default())  # a Sampler by its methods (the SDK is imported late)
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)  # type: ignore[arg-type]
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def _name_statements_after_queries() -> None:
    """psycopg's spans are named after the statement's first word, which for vigil's queries is
    ``--`` (each starts with its description comment). Name them after the query instead
    (``claim``, ``finish_runs``: the ``-- name:`` in ledger/queries/*.sql), found by the SQL
    text; any other statement keeps the instrumentation's name."""
    from opentelemetry.instrumentation import psycopg as instrumented  # late: see setup()

    # "": psycopg_pool's check of a connection before lending it (ConnectionPool.check_connection).
    names = statement_names() | {"": "pool_check"}
    base = instrumented.CursorTracer

    class NamedQueries(base):  # type: ignore[valid-type, misc]  # the instrumentation's class, found at run time
        def get_operation_name(self, cursor, args) -> str:
            if args and isinstance(args[0], str) and args[0] in names:
                return names[args[0]]
            return super().get_operation_name(cursor, args)

    # The instrumentation builds its tracer from this module attribute per connection.
    instrumented.CursorTracer = NamedQueries  # type: ignore[misc]


class CausedOnly:
    """A sampler: root spans of kind CLIENT (a SQL statement, an HTTP call that no request, event
    or timer caused) are dropped; everything else is ``delegate``'s decision."""

    def __init__(self, delegate):
        from opentelemetry.sdk.trace.sampling import Decision, SamplingResult  # late: see setup()

        self.delegate = delegate
        self._drop = SamplingResult(Decision.DROP)

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        if kind is SpanKind.CLIENT and not trace.get_current_span(parent_context).get_span_context().is_valid:
            return self._drop
        return self.delegate.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"CausedOnly{{{self.delegate.get_description()}}}"


# -- carrying contexts -------------------------------------------------------------------


def carrier(span: trace.Span | None = None) -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of ``span``, or of the current span."""
    headers: dict[str, str] = {}
    if span is None:
        propagate.inject(headers)
    else:
        propagate.inject(headers, context=trace.set_span_in_context(span))
    return {key: headers[key] for key in TRACE_HEADERS if key in headers}


def traceparent(span: trace.Span | None = None) -> str | None:
    return carrier(span).get("traceparent")


def context_of(headers: Mapping[str, str | None] | None):
    """The remote context in ``headers`` (a traceparent, maybe a tracestate), or None."""
    if not headers or not headers.get("traceparent"):
        return None
    context = propagate.extract({key: headers[key] for key in TRACE_HEADERS if headers.get(key)})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def span_context_of(headers: Mapping[str, str | None] | None):
    context = context_of(headers)
    return None if context is None else trace.get_current_span(context).get_span_context()


def kafka_headers(headers: Mapping[str, str]) -> list[tuple[str, str | bytes | None]] | None:
    """The trace context of an event's envelope headers, as Kafka record headers (None: none).

    Cheap enough to call for every produced event whether traces are on or not: a webhook's
    own ``traceparent`` travels on the record too.
    """
    if not headers.get("traceparent"):
        return None
    return [(key, headers[key].encode()) for key in TRACE_HEADERS if headers.get(key)]


def from_kafka(record_headers: list[tuple[str, bytes]] | None) -> dict[str, str]:
    """The trace context among a Kafka record's headers."""
    found = {}
    for key, value in record_headers or ():
        if key in TRACE_HEADERS and value:
            try:
                found[key] = value.decode("ascii")
            except UnicodeDecodeError:
                continue
    return found


def current_trace_id() -> str | None:
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def trace_id_of(span: trace.Span) -> str:
    return format(span.get_span_context().trace_id, "032x")


# -- spans -------------------------------------------------------------------------------


_OFF = contextlib.nullcontext()  # reusable: entering it binds None


def span(name: str, kind: SpanKind = SpanKind.INTERNAL, *, context=None, links=None, attributes=None):
    """A current span for the block (None when traces are off); an exception marks it an error."""
    if not enabled:
        return _OFF  # no generator set up per call: this sits on every tool call
    return _span(name, kind, context, links, attributes)


@contextlib.contextmanager
def _span(name: str, kind: SpanKind, context, links, attributes) -> Iterator:
    with _tracer.start_as_current_span(name, context=context, kind=kind, links=links, attributes=attributes) as s:
        with logs.context(trace_id=trace_id_of(s)):
            yield s


def started(name: str, kind: SpanKind, *, context=None, links=None, attributes=None, start_time=None):
    """A span that is not made current (ended by the caller)."""
    return _tracer.start_span(
        name, context=context, kind=kind, links=links, attributes=attributes, start_time=start_time
    )


def parent_and_links(contexts: Iterable[Any]) -> tuple[Any, list[Link]]:
    """The first of several remote span contexts as a parent, links to the other distinct ones."""
    parent, links, seen = None, [], set()
    for span_context in contexts:
        if span_context is None or (span_context.trace_id, span_context.span_id) in seen:
            continue
        seen.add((span_context.trace_id, span_context.span_id))
        if parent is None:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(span_context))
        else:
            links.append(Link(span_context))
    return parent, links


def failed(s, description: str | None, error_type: str | None = None) -> None:
    """Mark span ``s`` failed; ``error_type`` is the conventions' ``error.type`` (a low-cardinality
    class of failure, e.g. ``blocked`` apart from ``tool_error``)."""
    if s is not None:
        s.set_status(Status(StatusCode.ERROR, description))
        if error_type is not None:
            s.set_attribute("error.type", error_type)


def set_attribute(s, key: str, value: str) -> None:
    if s is not None:
        s.set_attribute(key, value)


def set_current(attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` on the current span (nothing when traces are off or none records)."""
    if enabled:
        current = trace.get_current_span()
        if current.is_recording():
            current.set_attributes(attributes)


def replayed(name: str, attributes: Mapping[str, Any]) -> None:
    """A step a run's journal replayed (nothing made again): a span of no duration under the
    current one, marked ``vigil.replayed``, so the trace shows the step without a call."""
    if enabled:
        now = now_ns()
        s = _tracer.start_span(name, attributes={**attributes, "vigil.replayed": True}, start_time=now)
        s.end(end_time=now)


def now_ns() -> int:
    return time.time_ns()


# -- ingest --------------------------------------------------------------------------------


def asgi_middleware():
    """The ASGI server-span middleware for ingest (with its arguments), or None when off.

    Span names start as the method only: the path holds user ids. RequestMetrics renames the
    span to the route template once the router found it (:func:`name_server_span`).
    """
    if not enabled:
        return None
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware  # late: see setup()

    def details(scope) -> tuple[str, dict]:
        return scope.get("method", "HTTP"), {}

    return OpenTelemetryMiddleware, {
        "excluded_urls": EXCLUDED_URLS,
        "default_span_details": details,
        "exclude_spans": ["receive", "send"],
    }


def name_server_span(method: str, route: str) -> None:
    s = trace.get_current_span()
    if s.is_recording():
        s.update_name(f"{method} {route}")
        s.set_attribute("http.route", route)


# -- awaiting under a span -----------------------------------------------------------------


async def within(s, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` with ``s`` current (and its trace id on every log line)."""
    with trace.use_span(s, end_on_exit=True, record_exception=True, set_status_on_exception=True):
        with logs.context(trace_id=trace_id_of(s)):
            return await awaitable
