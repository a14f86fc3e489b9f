"""The events a workload produces, and producing them the way vigil's producers do.

Every event is a chat message (the echo agent answers each run that has one with one outbox
row) of the same size, for users spread evenly (``u00000`` .. ``u00999``), encoded with
vigil's Avro codec and produced with :func:`vigil.bus.kafka.producer_config` (``acks=all``,
idempotence, ``murmur2_random``, 5 ms linger, lz4). ``received_at`` is stamped when the
event is handed to the producer, so the ledger can tell each event's produce-to-finish
latency afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from confluent_kafka import KafkaError, Producer

from vigil.bus.codec import EventCodec
from vigil.bus.kafka import producer_config
from vigil.envelope import Event
from vigil.settings import CommonSettings

KIND = "chat.message"
# About the size of a short chat message; the encoded envelope is ~170 bytes.
TEXT = "bench message, about as long as a short chat line: status?"
TICK_S = 0.005  # the paced producer's step: finer than the linger, coarse enough to be cheap

CODEC = EventCodec()


def user_id(index: int, users: int) -> str:
    return f"u{index % users:05d}"


def event(index: int, users: int, source: str, received_at: datetime | None = None) -> Event:
    return Event(
        user_id=user_id(index, users),
        source=source,
        source_id=f"{source}-{index}",
        kind=KIND,
        payload=json.dumps({"text": f"{TEXT} #{index}"}),
        received_at=received_at or datetime.now(UTC),
    )


def encoded(count: int, users: int, source: str) -> list[tuple[bytes, bytes]]:
    """``count`` events as (key, value) pairs, encoded before any clock starts."""
    now = datetime.now(UTC)
    out = []
    for index in range(count):
        ev = event(index, users, source, now)
        out.append((ev.user_id.encode(), CODEC.encode(ev)))
    return out


@dataclass
class Produced:
    count: int
    started: float  # wall clock (time.time()) of the first produce call
    finished: float  # wall clock when the last acknowledgement arrived


class BenchProducer:
    """One idempotent producer with vigil's settings; failures are counted, never ignored."""

    def __init__(self, bootstrap: str, topic: str):
        settings = CommonSettings(kafka_bootstrap=bootstrap, events_topic=topic)
        self.topic = topic
        self.errors: list[KafkaError] = []
        self.producer = Producer(
            producer_config(settings, **{"delivery.report.only.error": True, "on_delivery": self._on_delivery})
        )

    def close(self) -> None:
        """Flush and close: a producer left to the garbage collector outlives the bench's
        broker and fills the end of the output with connection-refused lines."""
        self.producer.flush(10)
        self.producer.close()

    def __enter__(self) -> BenchProducer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _on_delivery(self, err, _msg) -> None:
        if err is not None:
            self.errors.append(err)

    def _produce(self, key: bytes, value: bytes) -> None:
        while True:
            try:
                self.producer.produce(self.topic, value=value, key=key)
                return
            except BufferError:
                self.producer.poll(0.005)  # local queue full: let librdkafka send

    def _finish(self, count: int, started: float) -> Produced:
        left = self.producer.flush(60)
        if left or self.errors:
            raise RuntimeError(f"{left} events unsent, {len(self.errors)} refused: {self.errors[:1]}")
        return Produced(count, started, time.time())

    def blast(self, messages: list[tuple[bytes, bytes]]) -> Produced:
        """Produce pre-encoded messages as fast as the client goes."""
        started = time.time()
        for n, (key, value) in enumerate(messages):
            self._produce(key, value)
            if n % 1000 == 0:
                self.producer.poll(0)
        return self._finish(len(messages), started)

    def paced(self, rate: float, duration: float, users: int, source: str, first: int = 0) -> Produced:
        """Offer ``rate`` events/s for ``duration`` seconds, spread evenly over time.

        Each event is encoded when its turn comes, stamped with that moment, so its
        ``received_at`` is when it was offered, not when the round started.
        """
        started = time.time()
        start = time.monotonic()
        sent = 0
        total = max(1, int(rate * duration))
        while sent < total:
            due = min(total, int((time.monotonic() - start) * rate) + 1)
            if due > sent:
                now = datetime.now(UTC)
                for index in range(first + sent, first + due):
                    ev = event(index, users, source, now)
                    self._produce(ev.user_id.encode(), CODEC.encode(ev))
                sent = due
            self.producer.poll(0)
            time.sleep(TICK_S)
        return self._finish(sent, started)

    def in_thread(self, method, *args) -> Background:
        return Background(method, args)


class Background(threading.Thread):
    """Run a producing method on a thread; ``result()`` joins and returns (or re-raises)."""

    def __init__(self, method, args) -> None:
        super().__init__(name="bench-producer", daemon=True)
        self.method = method
        self.args = args
        self.value: Produced | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.method(*self.args)
        except BaseException as exc:  # handed to the caller by result()
            self.error = exc

    def result(self, timeout: float = 600) -> Produced:
        self.join(timeout)
        if self.error is not None:
            raise self.error
        if self.value is None:
            raise RuntimeError("producer did not finish in time")
        return self.value
