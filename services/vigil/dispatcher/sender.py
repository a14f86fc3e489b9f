"""Sending: the deliveries a claim fixed, on a pool of send threads.

A claim's deliveries are handed to ``VIGIL_DISPATCHER_CONCURRENCY`` threads in claim order;
each outcome, as its send finishes, goes to ``on_outcome`` (the recorder's). Nothing here
touches the ledger: every delivery it sends was fixed and committed by the claim first.

It also keeps which claims still have sends out (:class:`_Pass`), for the heartbeat gauges:
a claim is a finished pass once its outcomes and those of every claim before it are recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from opentelemetry.trace import SpanKind

from vigil import tracing
from vigil.clock import Clock, utc
from vigil.dispatcher import metrics
from vigil.dispatcher.channels import Channels, Delivery, Outcome, Result


def delivery_span(delivery: Delivery):
    """The span of one delivery attempt: a child of its first message's run (the outbox row's
    stored context), linked to the other messages' runs it joins."""
    parent, links = tracing.parent_and_links(
        tracing.span_context_of({"traceparent": row.traceparent}) for row in delivery.rows
    )
    return tracing.span(
        f"deliver {delivery.channel.type.value}",
        SpanKind.PRODUCER,
        context=parent,
        links=links,
        attributes={
            "vigil.user_id": delivery.user_id,
            "vigil.delivery_id": str(delivery.delivery_id),
            "vigil.delivery.attempt": delivery.attempt,
            "vigil.delivery.messages": len(delivery.rows),
        },
    )


@dataclass(slots=True)
class _Pass:
    """One claim's deliveries: ``open`` of them not finished yet."""

    claimed_at: float  # Unix time
    sweep_started: float | None  # the claim ended a sweep: that sweep's start (Unix time)
    open: int


class Sender:
    """The send pool. ``on_outcome(delivery, outcome)`` is called on the loop's thread, from
    :meth:`collect`, for each send that finished."""

    def __init__(
        self,
        concurrency: int,
        clock: Clock,
        channels: Channels,
        on_outcome: Callable[[Delivery, Outcome], None],
        shard: str = "0",
    ):
        self.clock = clock
        self.shard = shard  # the ledger shard whose claims these are (the heartbeat gauges' label)
        self.channels = channels
        self._on_outcome = on_outcome
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="send")
        # Sends waiting for a thread or being sent, with the claim that fixed them.
        self._in_flight: dict[Future[Outcome], tuple[Delivery, _Pass]] = {}
        self._passes: list[_Pass] = []  # claims whose deliveries are not all recorded yet

    @property
    def in_flight(self) -> int:
        """Deliveries handed over whose send has not finished (waiting for a thread or sending)."""
        return len(self._in_flight)

    def start(self, deliveries: list[Delivery], closed_sweep: float | None) -> None:
        """Hand a claim's deliveries to the send threads (in claim order). ``closed_sweep``:
        the start of the sweep the claim closed, if it closed one."""
        claim_pass = _Pass(time.time(), closed_sweep, len(deliveries))
        self._passes.append(claim_pass)
        for delivery in deliveries:
            self._in_flight[self._pool.submit(self._send, delivery)] = (delivery, claim_pass)

    def collect(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for sends to finish (none: until one does; no wait when
        nothing is in flight) and hand every finished one's outcome to ``on_outcome``."""
        if self._in_flight:
            done, _ = wait(self._in_flight, timeout=timeout, return_when=FIRST_COMPLETED)
            for future in done:
                delivery, claim_pass = self._in_flight.pop(future)
                claim_pass.open -= 1
                self._on_outcome(delivery, future.result())

    def finish_passes(self) -> None:
        """Called once every outcome handed over is recorded. A claim is a finished pass once
        its deliveries and those of every claim before it are recorded (so they finish in
        claim order): the heartbeat is the newest such claim's time. A sweep is finished with
        its closing claim: its start is the sweep gauge, so a value after a moment means
        everything due at that moment was claimed, sent and recorded."""
        while self._passes and self._passes[0].open == 0:
            done = self._passes.pop(0)
            metrics.LAST_PASS.labels(self.shard).set(done.claimed_at)
            if done.sweep_started is not None:
                metrics.LAST_SWEEP.labels(self.shard).set(done.sweep_started)

    def _send(self, delivery: Delivery) -> Outcome:
        # The attempt's time is taken when the send starts, not when it was queued: a
        # webhook's timestamp must be fresh when the receiver checks it.
        if not tracing.enabled:
            return self.channels.send(delivery, utc(self.clock.now()))
        with delivery_span(delivery) as span:
            outcome = self.channels.send(delivery, utc(self.clock.now()))
            span.set_attribute("vigil.delivery.result", outcome.result.value)
            if outcome.result is not Result.DELIVERED:
                tracing.failed(span, outcome.error)
            return outcome

    def close(self) -> None:
        """Let the sends in flight finish, then close the channels."""
        self._pool.shutdown(wait=True)
        self.channels.close()
