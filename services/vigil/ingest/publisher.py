"""Producing from request handlers without blocking the event loop, or leaving it.

The producer's delivery reports are served on the event loop itself: while any send waits
for its acknowledgement, the loop polls the producer every ``POLL_INTERVAL_S`` (without
waiting), and each report settles its request's future directly. There is no poll thread:
with one, every report took the GIL from the loop thread and woke the loop through
``call_soon_threadsafe``, and at 64 concurrent single-event requests that traffic, not the
broker, set the pace (see docs/performance.md). Concurrent requests share the producer and
its batches.

A handler answers 2xx only after :meth:`Publisher.send` returned, that is after the broker
acknowledged every event (``acks=all``); any failure, including no answer within
``VIGIL_PRODUCE_TIMEOUT_S``, becomes a 503 with ``Retry-After``. Some events of a failed
batch may still have been stored by the broker: the client's retry carries the same dedup
keys, so the ledger keeps one row each.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from confluent_kafka import KafkaError, KafkaException, Producer
from opentelemetry.trace import SpanKind

from vigil import tracing
from vigil.bus.codec import EventCodec
from vigil.bus.kafka import Delivered, ProduceError, producer_config
from vigil.envelope import Event
from vigil.ingest.metrics import EVENTS_PRODUCED, PRODUCE_FAILURES, PRODUCE_SECONDS
from vigil.ingest.requests import Refusal, invalid, unavailable
from vigil.settings import CommonSettings
from vigil.tracing import kafka_headers

log = logging.getLogger(__name__)

# How often the loop serves delivery reports while a send waits for one. A report waits
# half of it on average, small next to the producer's own linger (5 ms); a poll that finds
# nothing costs about a microsecond.
POLL_INTERVAL_S = 0.001
# ... and while nothing waits: only the producer's error callbacks (a fatal error, a broker
# going down) come then, and they need no haste.
IDLE_POLL_INTERVAL_S = 0.1
# Local queue full (librdkafka's buffer): how often to try again. The wait as a whole is
# bounded by the produce timeout, so a stuck broker still ends in a 503.
QUEUE_FULL_RETRY_S = 0.005
# Slack over librdkafka's own message timeout: its delivery report (a failure) normally
# settles the future first; this bound only matters if the report never comes.
ACK_SLACK_S = 1.0
# librdkafka counts a record's framing (length varints, attributes, headers count) against
# message.max.bytes too; a few dozen bytes, bounded generously.
MESSAGE_FRAMING_BYTES = 512


class _Batch:
    """The acknowledgements of one send: settles ``future`` once every report is in.

    Reports arrive on the event loop's thread (the loop polls the producer), so the future
    is settled directly.
    """

    __slots__ = ("future", "delivered", "errors", "remaining")

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int):
        self.future: asyncio.Future = loop.create_future()
        self.delivered: list[Delivered] = []
        self.errors: list[KafkaError] = []
        self.remaining = size

    def on_delivery(self, err: KafkaError | None, msg) -> None:
        if err is not None:
            self.errors.append(err)
        else:
            self.delivered.append(Delivered(msg.topic(), msg.partition(), msg.offset()))
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():  # the waiter may have given up
            self.future.set_result(True)

    def expire(self) -> None:
        if not self.future.done():
            self.future.set_result(False)


class Publisher:
    """One idempotent producer per process, rebuilt if librdkafka reports a fatal error."""

    def __init__(self, settings: CommonSettings):
        self.settings = settings
        self.topic = settings.events_topic
        # Ingest's settings carry the message bound its body bound derives from.
        self.max_message_bytes: int | None = getattr(settings, "kafka_message_max_bytes", None)
        self._fatal = False
        self._last_error: int | None = None
        self._codec: EventCodec | None = None
        self._producer: Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poll_handle: asyncio.TimerHandle | None = None
        self._waiting = 0  # sends waiting for their acknowledgements
        self._metrics: dict[str, tuple] = {}

    async def start(self) -> None:
        """Connect (librdkafka connects in the background: a broker that is down now is not
        an error) and start serving the producer's callbacks on this event loop."""
        self._loop = asyncio.get_running_loop()
        self._codec = await asyncio.to_thread(EventCodec, self.settings.schema_registry_url)
        self._producer = self._new_producer()
        self._poll_soon(IDLE_POLL_INTERVAL_S)

    def _new_producer(self) -> Producer:
        self._fatal = False
        config = producer_config(self.settings, error_cb=self._on_error)
        if self.max_message_bytes is not None:
            config["message.max.bytes"] = self.max_message_bytes
        return Producer(config)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            # An idempotent producer that hit a fatal error refuses every later produce;
            # without a rebuild, ingest would answer 503 until restarted.
            log.error("Kafka producer fatal error, rebuilding it: %s", err.str(), extra={"event": "producer_fatal"})
            self._fatal = True
        elif err.code() != self._last_error:  # broker-down errors repeat every few seconds
            log.warning("Kafka: %s", err.str())
        self._last_error = err.code()

    def _poll_soon(self, delay: float) -> None:
        if self._poll_handle is not None:
            self._poll_handle.cancel()
        assert self._loop is not None  # set by start()
        self._poll_handle = self._loop.call_later(delay, self._poll)

    def _poll(self) -> None:
        """Serve delivery reports and error callbacks; poll again soon while a send waits."""
        self._poll_handle = None
        if self._producer is None:
            return
        try:
            self._producer.poll(0)
        finally:
            # Even if a callback raised: without the next poll every later send would wait
            # for its deadline.
            self._poll_soon(POLL_INTERVAL_S if self._waiting else IDLE_POLL_INTERVAL_S)

    async def send(self, events: Sequence[Event], via: str) -> list[Delivered]:
        """Produce ``events`` and return once the broker acknowledged all of them.

        Raises a 503 :class:`~vigil.ingest.requests.Refusal` otherwise. ``via`` is the
        endpoint family, for metrics.
        """
        seconds, produced, failures = self._metrics_for(via)
        started = time.perf_counter()
        try:
            if tracing.enabled:
                delivered = await self._traced_send(events)
            else:
                delivered = await self._send(events)
        except ProduceError as exc:
            failures.inc()
            raise unavailable("broker_unavailable", f"the event broker did not acknowledge: {exc}") from None
        seconds.observe(time.perf_counter() - started)
        produced.inc(len(delivered))
        return delivered

    async def _traced_send(self, events: Sequence[Event]) -> list[Delivered]:
        """:meth:`_send` under a producer span whose context every event carries (its envelope
        headers, stored with it in the ledger, and the record's headers): the worker continues it.
        A webhook's own ``traceparent`` is replaced by this span's, a descendant of it."""
        with tracing.span(
            f"send {self.topic}",
            SpanKind.PRODUCER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.destination.name": self.topic,
                "messaging.batch.message_count": len(events),
            },
        ) as span:
            context = tracing.carrier(span)
            return await self._send([replace(event, headers={**event.headers, **context}) for event in events])

    def _metrics_for(self, via: str) -> tuple:
        # Looking a labelled child up costs more than using it; there are four families.
        metrics = self._metrics.get(via)
        if metrics is None:
            metrics = (PRODUCE_SECONDS.labels(via), EVENTS_PRODUCED.labels(via), PRODUCE_FAILURES.labels(via))
            self._metrics[via] = metrics
        return metrics

    async def _send(self, events: Sequence[Event]) -> list[Delivered]:
        if not events:
            return []
        if self._producer is None:
            raise ProduceError("the producer is not started")
        if self._fatal:
            # Reports the old producer still has fail their batches now; a batch whose
            # report never comes ends at its deadline (503).
            old, self._producer = self._producer, self._new_producer()
            old.poll(0)
        # Every event is encoded and measured before the first is produced: one that cannot be
        # sent refuses the whole request, and nothing of it reaches the broker.
        encoded = self._encode(events)
        producer = self._producer
        timeout = self.settings.produce_timeout_s
        loop = self._loop
        assert loop is not None  # set by start()
        deadline = loop.time() + timeout
        batch = _Batch(loop, len(events))
        self._waiting += 1
        if self._waiting == 1:
            self._poll_soon(POLL_INTERVAL_S)
        try:
            for event, (key, value) in zip(events, encoded):
                headers = kafka_headers(event.headers)  # the trace context, where Kafka tooling looks
                while True:
                    try:
                        producer.produce(
                            self.topic, value=value, key=key, headers=headers, on_delivery=batch.on_delivery
                        )
                        break
                    except BufferError:
                        if loop.time() > deadline:
                            raise ProduceError("the producer's local queue stayed full") from None
                        await asyncio.sleep(QUEUE_FULL_RETRY_S)
                    except KafkaException as exc:
                        raise ProduceError(f"produce refused: {exc}") from None
            expiry = loop.call_at(deadline + ACK_SLACK_S, batch.expire)
            try:
                acknowledged = await batch.future
            finally:
                expiry.cancel()
        finally:
            self._waiting -= 1
        if not acknowledged:
            raise ProduceError(f"no acknowledgement within {timeout:.1f}s")
        if batch.errors:
            raise ProduceError(f"{len(batch.errors)} of {len(events)} not acknowledged: {batch.errors[0].str()}")
        return batch.delivered

    def _encode(self, events: Sequence[Event]) -> list[tuple[bytes, bytes]]:
        """Each event as (key, value); a 400 or 413 refusal for the first that cannot be sent.

        The request's validation should have caught both already; this is the backstop that
        keeps "accepted, then refused by the producer" (a 503 no retry can cure) impossible.
        """
        limit = self.max_message_bytes
        encoded = []
        assert self._codec is not None  # set by start()
        for index, event in enumerate(events):
            where = f"events[{index}]" if len(events) > 1 else "event"
            try:
                value = self._codec.encode(event, self.topic)
                key = event.user_id.encode()
            except (ValueError, TypeError, OverflowError) as exc:  # a lone surrogate, a date out of range
                raise invalid(where, f"cannot be encoded ({type(exc).__name__})", code="invalid_event") from None
            if limit is not None and len(value) + len(key) + MESSAGE_FRAMING_BYTES > limit:
                raise Refusal(
                    413,
                    "event_too_large",
                    f"{where} is {len(value)} bytes as a Kafka message; the broker takes at most {limit}",
                    field=where,
                )
            encoded.append((key, value))
        return encoded

    async def close(self, timeout: float = 5.0) -> None:
        """Serve reports up to ``timeout`` until queued events are answered (their requests
        are still waiting), then stop."""
        producer = self._producer
        if producer is None:
            return
        deadline = time.monotonic() + timeout
        while len(producer) > 0 and time.monotonic() < deadline:
            producer.poll(0)
            await asyncio.sleep(POLL_INTERVAL_S)
        producer.poll(0)
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        self._producer = None
