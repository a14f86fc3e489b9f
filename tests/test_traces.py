"""Traces (vigil.tracing): one chat message, one trace, spans from all four services.

The four services run as real processes on the real broker and ledger (the Claude agent
through the real SDK and the scripted Messages API server) with ``OTEL_EXPORTER_OTLP_ENDPOINT``
pointing at an OTLP/HTTP receiver in this process, which decodes every
``ExportTraceServiceRequest`` with opentelemetry-proto. The message comes with a
``traceparent`` of its own (a caller that traces), asks for a follow-up a second later, and
gets a reply; the follow-up's timer fires and its run replies again. All of it must be one
trace: ingest (joined to the caller's span), worker (record, claim, run, model and tool
calls, finish), dispatcher (both deliveries) and scheduler (the fire).
"""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind

from ingest_support import create_token
from otlp_support import OtlpReceiver, Span
from support import scalar, wait_for
from vigil import tracing
from vigil_dev.scripted_server import ScriptedServer
from worker_support import FAST

SERVICES = ("ingest", "worker", "scheduler", "dispatcher")
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SCRIPT = {
    "rules": [
        # The follow-up's run: its event carries the note. First: the run resumes the first run's
        # conversation, so the event joins the turn holding that run's tool results.
        {
            "when": {"user_text": "ping-the-trace"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "here is your reminder"}}],
        },
        {"when": {"tool_result": "send_message"}, "reply": []},
        # The message's first model call is overloaded once: the SDK's retry is a second call
        # span, and the worker logs the retry inside the run (run_id and trace_id on the line).
        {"when": {"user_text": "remind me"}, "times": 1, "error": {"status": 529, "retry_after": 0}},
        {
            "when": {"user_text": "remind me"},
            "reply": [
                {"type": "tool_use", "name": "send_message", "input": {"text": "will do"}},
                {"type": "tool_use", "name": "set_followup", "input": {"delay_seconds": 1, "note": "ping-the-trace"}},
            ],
        },
    ]
}


def tree(spans: list[Span]) -> str:
    """The spans as an indented tree: service / span name, children under their parent."""
    by_parent = defaultdict(list)
    ids = {s.span_id for s in spans}
    for s in spans:
        by_parent[s.parent if s.parent in ids else "root"].append(s)
    lines = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda s: s.start):
            link = f"  (links {len(s.links)})" if s.links else ""
            parent_note = "" if depth else f"  <- parent {s.parent or 'none'}"
            lines.append(f"{'  ' * depth}{s.service} / {s.name}{link}{parent_note}")
            walk(s.span_id, depth + 1)

    walk("root", 0)
    return "\n".join(lines)


@pytest.fixture
def claude():
    with ScriptedServer(SCRIPT) as server:
        yield server


@pytest.fixture
def receiver():
    with OtlpReceiver() as server:
        yield server


@pytest.mark.slow
def test_one_chat_message_is_one_trace_across_the_four_services(
    claude, receiver, stack, ledger, topics, vigil_env, spawn, tmp_path
):
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    ports = {name: int(vigil_env[f"VIGIL_{name.upper()}_PORT"]) for name in SERVICES}
    envs = {
        "worker": {
            **vigil_env,
            **FAST,
            **otel,
            "VIGIL_AGENT": "claude",
            "ANTHROPIC_BASE_URL": claude.base_url,
            "ANTHROPIC_API_KEY": "scripted-test-key",
            "VIGIL_MODEL": "claude-scripted-1",
        },
        "ingest": {**vigil_env, **otel},
        "scheduler": {**vigil_env, **otel, "VIGIL_SCHEDULER_TICK_S": "0.2"},
        "dispatcher": {**vigil_env, **otel, "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.1", "VIGIL_OUTBOX_GAP": "0"},
    }
    procs = {name: spawn([name], envs[name], name=name).wait_healthy(ports[name]) for name in SERVICES}

    token = create_token(ledger)["token"]
    answer = httpx.post(
        f"http://127.0.0.1:{ports['ingest']}/v1/users/u-trace/messages",
        json={"text": "remind me later"},
        headers={"Authorization": f"Bearer {token}", "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
    )
    assert answer.status_code == 202, answer.text
    wait_for(
        lambda: scalar(ledger, "SELECT count(*) FROM outbox WHERE delivered_at IS NOT NULL") >= 2,
        90,
        "the reply and the follow-up's reply delivered",
    )
    # The runs' context is on what they wrote.
    assert scalar(ledger, f"SELECT count(*) FROM outbox WHERE traceparent LIKE '00-{CALLER_TRACE}-%'") == 2
    assert scalar(ledger, f"SELECT count(*) FROM timers WHERE traceparent LIKE '00-{CALLER_TRACE}-%'") == 1

    def names(spans: list[Span]) -> dict[str, set[str]]:
        found = defaultdict(set)
        for s in spans:
            found[s.service].add(s.name)
        return found

    def complete() -> bool:
        spans = receiver.trace(CALLER_TRACE)
        by_service = names(spans)
        return (
            sum(1 for s in spans if s.name.startswith("deliver ")) == 2
            and sum(1 for s in spans if s.name == "vigil.finish") == 2
            and all(f"vigil-{name}" in by_service for name in SERVICES)
        )

    try:
        wait_for(complete, 30, "the spans of both runs and both deliveries exported")
    finally:
        spans = receiver.trace(CALLER_TRACE)
        shown = tree(spans)
        (tmp_path / "span-tree.txt").write_text(shown)
        print(f"\nspan tree of trace {CALLER_TRACE} ({len(spans)} spans):\n{shown}")

    by_id = {s.span_id: s for s in spans}

    def one(service: str, name: str, nth: int = 0) -> Span:
        found = sorted(
            (s for s in spans if s.service == f"vigil-{service}" and s.name == name), key=lambda s: s.span_id
        )
        assert len(found) > nth, f"no {service} / {name} in:\n{shown}"
        return found[nth]

    def parent(s: Span) -> Span:
        assert s.parent in by_id, f"{s.service} / {s.name} has no parent in the trace:\n{shown}"
        return by_id[s.parent]

    def ancestors(s: Span) -> list[str]:
        chain = []
        while s.parent in by_id:
            s = by_id[s.parent]
            chain.append(f"{s.service} / {s.name}")
        return chain

    # One root: ingest's server span, a child of the caller's span; every other span hangs off it.
    roots = [s for s in spans if s.parent not in by_id]
    assert [(r.service, r.name, r.parent) for r in roots] == [
        ("vigil-ingest", "POST /v1/users/{user_id}/messages", CALLER_SPAN)
    ], shown
    server = roots[0]
    produce = one("ingest", f"send {topics.events}")
    assert parent(produce) == server
    records = [s for s in spans if s.name == f"process {topics.events}"]
    runs = [s for s in spans if s.name == "vigil.run"]
    assert len(records) == 2 and len(runs) == 2, shown
    # The message's run: record under ingest's produce, run under the record, its claim, its
    # conversation (invoke_agent) with the model calls (two: the overload and the retry) and
    # their HTTP attempts, and the tools; the finish.
    first_record = next(s for s in records if parent(s) == produce)
    first_run = next(s for s in runs if parent(s) == first_record)
    assert first_run.attributes["vigil.profile"] == "default", shown
    run_children = sorted(s.name for s in spans if s.parent == first_run.span_id)
    assert "vigil.claim" in run_children and "vigil.finish" in run_children, shown
    [agent] = [s for s in spans if s.parent == first_run.span_id and s.name.startswith("invoke_agent ")]
    assert agent.name == "invoke_agent default" and agent.attributes["gen_ai.agent.name"] == "default", shown
    assert agent.attributes["gen_ai.conversation.id"].startswith("ses-"), agent.attributes
    children = [s for s in spans if s.parent == agent.span_id]
    child_names = sorted(s.name for s in children)
    assert {"execute_tool send_message", "execute_tool set_followup"} <= set(child_names), shown
    model_calls = {s.span_id for s in children if s.kind == PbSpan.SPAN_KIND_CLIENT}
    assert len(model_calls) >= 2, f"the SDK's call spans (overload, retry) under the run:\n{shown}"
    attempts = [s for s in spans if s.parent in model_calls and s.kind == PbSpan.SPAN_KIND_CLIENT]
    assert len(attempts) >= 2, f"aiohttp's spans of the HTTP attempts under the model calls:\n{shown}"
    # The follow-up: the scheduler's fire continues the first run; its event's record, run,
    # finish and delivery follow under it.
    fire = one("scheduler", "fire timer.followup")
    assert parent(fire) == first_run, shown
    second_record = next(s for s in records if s is not first_record)
    assert parent(second_record) == fire
    second_run = next(s for s in runs if s is not first_run)
    assert parent(second_run) == second_record
    deliveries = [s for s in spans if s.service == "vigil-dispatcher" and s.name.startswith("deliver ")]
    assert sorted(parent(d).span_id for d in deliveries) == sorted([first_run.span_id, second_run.span_id]), shown
    assert "vigil-scheduler / fire timer.followup" in ancestors(deliveries[0]) + ancestors(deliveries[1])

    # The worker's JSON lines logged inside the run name the run and the trace.
    lines = [json.loads(line) for line in procs["worker"].log().splitlines()]
    in_run = [r for r in lines if r.get("trace_id") == CALLER_TRACE and r.get("run_id")]
    assert in_run, "no worker log line with run_id and trace_id"
    assert in_run[0]["run_id"].startswith("u-trace:")
    print("worker log line inside the run:", json.dumps(in_run[0]))


def test_traces_off_cost_nothing_and_add_nothing(monkeypatch):
    """Without an OTLP endpoint setup() installs nothing, and the hot-path helpers step aside:
    the run's coroutine is the run itself, not a wrapper around it."""
    from vigil.worker import traces

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not tracing.endpoint_configured()
    assert tracing.setup("test") is False and tracing.enabled is False

    async def run():
        return None

    coro = run()
    assert traces.run(coro, claim=None, pool=None) is coro
    coro.close()
    with tracing.span("anything") as span:
        assert span is None
    assert tracing.kafka_headers({}) is None
    assert tracing.kafka_headers({"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}) == [
        ("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01".encode())
    ]


def test_calls_without_a_traced_cause_are_dropped():
    """The sampler drops root CLIENT spans (the dispatcher's and scheduler's polls would be a
    trace each, every 100 ms) and keeps CLIENT spans that have a parent, and every other root."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing.CausedOnly(ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("poll", kind=SpanKind.CLIENT):
        pass
    with tracer.start_as_current_span("request", kind=SpanKind.SERVER):
        with tracer.start_as_current_span("SELECT", kind=SpanKind.CLIENT):
            pass
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["SELECT", "request"]


def test_a_run_of_several_events_continues_the_first_and_links_the_others():
    first = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    second = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    contexts = [tracing.span_context_of(h) for h in (first, {"traceparent": None}, second, first)]
    parent, links = tracing.parent_and_links(contexts)
    parent_span = tracing.trace.get_current_span(parent).get_span_context()
    assert format(parent_span.trace_id, "032x") == CALLER_TRACE and format(parent_span.span_id, "016x") == CALLER_SPAN
    # The empty one is skipped, the repeated first one is not linked to itself.
    assert [format(link.context.span_id, "016x") for link in links] == ["b7ad6b7169203331"]
