"""Producing from request handlers without blocking the event loop.

:class:`EventProducer` waits for acknowledgements on a thread; a request handler instead
awaits an asyncio future that the producer's delivery callback settles (from the
producer's poll thread, through ``call_soon_threadsafe``), one wake-up per request however
many events it carries. Concurrent requests share the producer and its batches.

A handler answers 2xx only after :meth:`Publisher.send` returned, that is after the broker
acknowledged every event (``acks=all``); any failure, including no answer within
``VIGIL_PRODUCE_TIMEOUT_S``, becomes a 503 with ``Retry-After``. Some events of a failed
batch may still have been stored by the broker: the client's retry carries the same dedup
keys, so the ledger keeps one row each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Sequence

from confluent_kafka import KafkaError, KafkaException

from vigil.bus.codec import Event
from vigil.bus.kafka import Delivered, EventProducer, ProduceError
from vigil.ingest.metrics import EVENTS_PRODUCED, PRODUCE_FAILURES, PRODUCE_SECONDS
from vigil.ingest.requests import unavailable
from vigil.settings import CommonSettings

log = logging.getLogger(__name__)

# Local queue full (librdkafka's buffer): how often to try again. The wait as a whole is
# bounded by the produce timeout, so a stuck broker still ends in a 503.
QUEUE_FULL_RETRY_S = 0.005
# Slack over librdkafka's own message timeout: its delivery report (a failure) normally
# settles the future first; this bound only matters if the report never comes.
ACK_SLACK_S = 1.0


class _Batch:
    """The acknowledgements of one send: settles ``future`` once every report is in."""

    __slots__ = ("future", "loop", "delivered", "errors", "remaining", "lock")

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int):
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.delivered: list[Delivered] = []
        self.errors: list[KafkaError] = []
        self.remaining = size
        self.lock = threading.Lock()

    def on_delivery(self, err: KafkaError | None, msg) -> None:
        """librdkafka's delivery report (on the poll thread); one wake-up of the loop per batch."""
        with self.lock:
            if err is not None:
                self.errors.append(err)
            else:
                self.delivered.append(Delivered(msg.topic(), msg.partition(), msg.offset()))
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.loop.call_soon_threadsafe(_settle, self.future)


def _settle(future: asyncio.Future) -> None:
    if not future.done():  # the waiter may have given up already
        future.set_result(None)


class _NonBlockingProducer(EventProducer):
    """:class:`EventProducer` plus a produce call that returns at once (the ack comes later)."""

    def produce_nowait(self, event: Event, on_delivery) -> None:
        """Queue one event; raises BufferError when the local queue is full."""
        value = self.codec.encode(event, self.topic)
        self._producer.produce(self.topic, value=value, key=event.user_id.encode(), on_delivery=on_delivery)


class Publisher:
    """One idempotent producer per process, rebuilt if librdkafka reports a fatal error."""

    def __init__(self, settings: CommonSettings):
        self.settings = settings
        self._fatal = False
        self._last_error: int | None = None
        self._producer: _NonBlockingProducer | None = None

    def start(self) -> None:
        """Connect (librdkafka connects in the background: a broker that is down now is not an error)."""
        self._producer = self._new_producer()

    def _new_producer(self) -> _NonBlockingProducer:
        self._fatal = False
        return _NonBlockingProducer(self.settings, error_cb=self._on_error)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            # An idempotent producer that hit a fatal error refuses every later produce;
            # without a rebuild, ingest would answer 503 until restarted.
            log.error("Kafka producer fatal error, rebuilding it: %s", err.str())
            self._fatal = True
        elif err.code() != self._last_error:  # broker-down errors repeat every few seconds
            log.warning("Kafka: %s", err.str())
        self._last_error = err.code()

    async def send(self, events: Sequence[Event], via: str) -> list[Delivered]:
        """Produce ``events`` and return once the broker acknowledged all of them.

        Raises a 503 :class:`~vigil.ingest.requests.Refusal` otherwise. ``via`` is the
        endpoint family, for metrics.
        """
        started = time.perf_counter()
        try:
            delivered = await self._send(events)
        except ProduceError as exc:
            PRODUCE_FAILURES.labels(via).inc()
            raise unavailable("broker_unavailable", f"the event broker did not acknowledge: {exc}") from None
        PRODUCE_SECONDS.labels(via).observe(time.perf_counter() - started)
        EVENTS_PRODUCED.labels(via).inc(len(delivered))
        return delivered

    async def _send(self, events: Sequence[Event]) -> list[Delivered]:
        if not events:
            return []
        if self._producer is None:
            raise ProduceError("the producer is not started")
        if self._fatal:
            old, self._producer = self._producer, self._new_producer()
            await asyncio.to_thread(old.close, 0)
        producer = self._producer
        timeout = self.settings.produce_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        batch = _Batch(loop, len(events))
        for event in events:
            while True:
                try:
                    producer.produce_nowait(event, batch.on_delivery)
                    break
                except BufferError:
                    if loop.time() > deadline:
                        raise ProduceError("the producer's local queue stayed full") from None
                    await asyncio.sleep(QUEUE_FULL_RETRY_S)
                except KafkaException as exc:
                    raise ProduceError(f"produce refused: {exc}") from None
        try:
            await asyncio.wait_for(asyncio.shield(batch.future), max(0.0, deadline - loop.time()) + ACK_SLACK_S)
        except asyncio.TimeoutError:
            raise ProduceError(f"no acknowledgement within {timeout:.1f}s") from None
        if batch.errors:
            raise ProduceError(f"{len(batch.errors)} of {len(events)} not acknowledged: {batch.errors[0].str()}")
        return batch.delivered

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` for queued events (their requests are still waiting), then stop."""
        if self._producer is not None:
            self._producer.close(timeout)
            self._producer = None
