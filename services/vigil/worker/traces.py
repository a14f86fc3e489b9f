"""The worker's spans: record, run (with its claim), finish. See :mod:`vigil.tracing`.

Each function here is called only when ``tracing.enabled``, or returns at once when it is
off, so the worker's hot paths (the consumer's decode, the run loop) pay nothing for traces
that are not exported.

- record: one ``vigil.record`` span per polled event, from the poll to the batch's commit, a
  child of the context the event carries (envelope headers, else the Kafka record's); its
  own context replaces that one in the headers the ledger stores, so the run continues it.
- run: ``vigil.run`` around the run's task, a child of its first event's stored context and
  linked to the others'; it begins with a ``vigil.claim`` span from the claim's statement
  (``events.claimed_at``) to the run's start. Its context is kept on the claim
  (``Claim.traceparent``): the finish writes it on the run's outbox rows and timers.
- finish: ``vigil.finish`` under the run, the group commit's time, stale runs marked errors.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from vigil import logs, tracing
from vigil.ledger import tracing as ledger_tracing
from vigil.ledger.claims import Claim
from vigil.ledger.db import AsyncPool
from vigil.worker.finish import Finished

HEADERS = 7  # a staging row's headers column (after n, user_id, source, source_id, kind, payload, session_id)
PARTITION, OFFSET = 11, 12


class RecordSpans:
    """The record spans of one polled batch."""

    __slots__ = ("spans", "topic")

    def __init__(self, topic: str):
        self.topic = topic
        self.spans: list[Span] = []

    def add(self, row: tuple[Any, ...], record_headers: list[tuple[str, bytes]] | None) -> tuple[Any, ...]:
        """Start the event's record span; return the row with its context in the headers."""
        headers = row[HEADERS]
        parent = tracing.context_of(headers)
        if parent is None:
            carried = tracing.from_kafka(record_headers)
            parent = tracing.context_of(carried)
        s = tracing.started(
            f"process {self.topic}",
            SpanKind.CONSUMER,
            context=parent,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.destination.name": self.topic,
                "messaging.destination.partition.id": str(row[PARTITION]),
                "messaging.kafka.offset": row[OFFSET],
                "vigil.user_id": row[1],
                "vigil.event.source": row[2],
                "vigil.event.kind": row[4],
            },
        )
        self.spans.append(s)
        return (*row[:HEADERS], {**headers, **tracing.carrier(s)}, *row[HEADERS + 1 :])

    def end(self, recorded: int | None) -> None:
        """The batch committed (``recorded`` new events) or was given up (None)."""
        for s in self.spans:
            if recorded is None:
                tracing.failed(s, "not recorded: the worker stopped with the ledger unreachable")
            s.end()


def run(coro: Coroutine[Any, Any, None], claim: Claim, pool: AsyncPool) -> Coroutine[Any, Any, None]:
    """``coro`` (a run) under its span; ``coro`` itself when traces are off."""
    if not tracing.enabled:
        return coro
    return _traced_run(coro, claim, pool)


async def _traced_run(coro: Coroutine[Any, Any, None], claim: Claim, pool: AsyncPool) -> None:
    started = tracing.now_ns()
    lookup_error = None
    try:
        async with pool.connection() as conn:
            rows = await ledger_tracing.event_trace_context(conn, claim.event_ids)
    except Exception as exc:  # the trace is not worth the run: it goes ahead as a trace of its own
        rows = []
        lookup_error = f"{type(exc).__name__}: {exc}"
    except BaseException:  # cancelled (a revoke) before the run started: it never will
        coro.close()
        raise
    parent, links = tracing.parent_and_links(tracing.span_context_of(row.headers) for row in rows)
    claimed = [row.claimed_at for row in rows if row.claimed_at is not None]
    claimed_ns = min(int(at.timestamp() * 1e9) for at in claimed) if claimed else started
    s = tracing.started(
        "vigil.run",
        SpanKind.INTERNAL,
        context=parent,
        links=links,
        start_time=min(claimed_ns, started),
        attributes={
            "vigil.user_id": claim.user_id,
            "vigil.run_key": claim.run_key,
            "vigil.events": len(claim.events),
            "vigil.attempt": claim.attempt,
            "vigil.partition": claim.home.partition,
            "vigil.epoch": claim.epoch,
        },
    )
    if lookup_error is not None:
        s.set_attribute("vigil.trace_context_error", lookup_error)
    claim.traceparent = tracing.traceparent(s)
    inner = tracing.started(
        "vigil.claim",
        SpanKind.INTERNAL,
        context=trace.set_span_in_context(s),
        start_time=min(claimed_ns, started),
        attributes={"vigil.event_ids": claim.event_ids},
    )
    inner.end(end_time=started)
    with logs.context(trace_id=tracing.trace_id_of(s)):
        await tracing.within(s, coro)


def finish(batch: Sequence[Finished], began_ns: int, committed: Sequence[Finished]) -> None:
    """One ``vigil.finish`` span per run of a group commit, under the run's span."""
    if not tracing.enabled:
        return
    ended = tracing.now_ns()
    landed = {id(run) for run in committed}
    for run in batch:
        context = tracing.context_of({"traceparent": run.claim.traceparent} if run.claim.traceparent else None)
        s = tracing.started(
            "vigil.finish",
            SpanKind.INTERNAL,
            context=context,
            start_time=began_ns,
            attributes={"vigil.group": len(batch), "vigil.outcome": run.outcome.value},
        )
        if id(run) not in landed:
            tracing.failed(s, "stale: the claim's epoch is no longer current; nothing written")
        s.end(end_time=ended)
