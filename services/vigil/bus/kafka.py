"""Kafka clients as vigil configures them: producers, consumers, topics.

Producers vigil owns all use the same settings (:func:`producer_config`): ``acks=all`` and
idempotence, so an acknowledged event is on every in-sync replica exactly once per produce
call; and the ``murmur2_random`` partitioner, which is the Java client's default. librdkafka's
own default (``consistent_random``, CRC32) would put the same user on a different partition
than a Java or Go producer does, and vigil's claim rule depends on one user landing on one
home partition.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec

from vigil import tracing
from vigil.bus.codec import EventCodec
from vigil.envelope import Event
from vigil.errors import VigilError
from vigil.settings import CommonSettings

log = logging.getLogger(__name__)

# Batching: a few milliseconds of linger lets ingest's concurrent requests share a produce
# request without adding latency a person would notice.
PRODUCER_LINGER_MS = 5
PRODUCER_BATCH_BYTES = 256 * 1024


# Kafka record headers, as the client takes them.
Headers = list[tuple[str, str | bytes | None]]


class ProduceError(VigilError):
    """The broker did not acknowledge an event (or not in time). Nothing may claim success."""


def producer_config(settings: CommonSettings, **extra: object) -> dict[str, Any]:
    config = settings.kafka_client_options()
    config.update(
        {
            "acks": "all",
            "enable.idempotence": True,
            "partitioner": "murmur2_random",
            "linger.ms": PRODUCER_LINGER_MS,
            "batch.size": PRODUCER_BATCH_BYTES,
            "compression.type": "lz4",
            # Bound the whole delivery (retries included) so callers get an answer.
            "message.timeout.ms": int(settings.produce_timeout_s * 1000),
            "client.id": f"vigil-{settings.instance_id}",
        }
    )
    config.update(extra)
    return config


# A broker answers a consumer's fetch once this much waits for it, or after this long. With
# librdkafka's defaults (1 byte, 500 ms) every fetch was answered at once, so under load the
# broker served one per few messages. At 7,700 events/s: the broker's CPU 13.9 -> 11.6 s over
# the same rounds; the e2e bench 14,735 -> 15,581 events/s with one worker, 16,592 -> 18,513
# with two (docs/performance.md, change 15). An event at low load waits at most the 10 ms
# more (5 at the median at 200 events/s). VIGIL_KAFKA_OPT_FETCH_* override them.
FETCH_MIN_BYTES = 64 * 1024
FETCH_WAIT_MAX_MS = 10
# librdkafka's statistics (the consumer lag gauges): VIGIL_KAFKA_OPT_STATISTICS_INTERVAL_MS
# overrides it, as the tests that wait for a report do.
STATS_INTERVAL_MS = 15_000


def consumer_config(
    settings: CommonSettings,
    *,
    group: str,
    session_timeout_ms: int,
    max_poll_interval_ms: int,
    on_stats: Callable[[str], None],
) -> dict[str, Any]:
    """A group member that stores its offsets by hand, once what it read is durable (the
    worker: after the ledger's commit), and lets the periodic auto-commit send them."""
    config: dict[str, Any] = {
        "fetch.min.bytes": FETCH_MIN_BYTES,
        "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
        "statistics.interval.ms": STATS_INTERVAL_MS,
    }
    config.update(settings.kafka_client_options())
    config.update(
        {
            "group.id": group,
            "client.id": f"vigil-worker-{settings.instance_id}",
            "partition.assignment.strategy": "cooperative-sticky",
            "enable.auto.commit": True,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": session_timeout_ms,
            # A member learns that a rebalance began from its next heartbeat: every rebalance
            # (a join, a hand-over's second round, a failover) waits up to one interval for
            # each member. A tenth of the session (1 s by default) instead of a fifth: the
            # rebalance bench's moved partitions reached the next owner's ledger 1.88 s after
            # the hand-over began with a fifth (docs/performance.md, "Rebalances").
            "heartbeat.interval.ms": max(500, session_timeout_ms // 10),
            "max.poll.interval.ms": max_poll_interval_ms,
            "stats_cb": on_stats,
        }
    )
    return config


@dataclass(frozen=True, slots=True)
class Delivered:
    topic: str
    partition: int
    offset: int


class EventProducer:
    """Produce events and wait until the broker acknowledged each of them.

    :meth:`send` returns only when every event is acknowledged, or raises
    :class:`ProduceError`: a failed delivery is an error, never ignored. A background thread
    serves delivery callbacks so concurrent callers (ingest's request handlers) share one
    producer and its batches.
    """

    def __init__(self, settings: CommonSettings, codec: EventCodec | None = None, **extra: object):
        self.settings = settings
        self.topic = settings.events_topic
        self.codec = codec or EventCodec(settings.schema_registry_url)
        self._producer = Producer(producer_config(settings, **extra))
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="producer-poll", daemon=True)
        self._poller.start()

    def _poll_loop(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(0.1)

    def send(self, events: Iterable[Event], timeout: float | None = None, topic: str | None = None) -> list[Delivered]:
        topic = topic or self.topic
        # An event's trace context rides on the record's headers too, where Kafka tooling looks.
        messages = [
            (event.user_id.encode(), self.codec.encode(event, topic), tracing.kafka_headers(event.headers))
            for event in events
        ]
        return self.send_raw(messages, topic, timeout)

    def send_raw(
        self,
        messages: list[tuple[Any, ...]],
        topic: str,
        timeout: float | None = None,
        headers: Headers | None = None,
        partition: int | None = None,
    ) -> list[Delivered]:
        """Produce ``messages``, each ``(key, value)`` with ``headers``, or ``(key, value, its
        own headers)``, and wait for every acknowledgement (see the class). ``partition``:
        every message to that partition, not the partitioner's."""
        timeout = self.settings.produce_timeout_s if timeout is None else timeout
        results: list[Delivered | KafkaError | None] = [None] * len(messages)
        remaining = [len(messages)]
        done = threading.Event()
        lock = threading.Lock()
        if not messages:
            return []

        def callback(index: int) -> Callable[[KafkaError | None, Message], None]:
            def on_delivery(err: KafkaError | None, msg: Message) -> None:
                # An acknowledged message has its topic, partition and offset (the stubs allow None).
                results[index] = err if err is not None else Delivered(msg.topic(), msg.partition(), msg.offset())  # type: ignore[arg-type]
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

            return on_delivery

        for index, (key, value, *own) in enumerate(messages):
            record_headers = own[0] if own else headers
            while True:
                try:
                    self._producer.produce(
                        topic,
                        value=value,
                        key=key,
                        headers=record_headers,
                        on_delivery=callback(index),
                        partition=-1 if partition is None else partition,  # -1: the partitioner's choice
                    )
                    break
                except BufferError:
                    # Local queue full: let the poller drain it rather than fail the caller.
                    time.sleep(0.005)
                except KafkaException as exc:
                    raise ProduceError(f"produce refused: {exc}") from None
        if not done.wait(timeout + 1.0):
            raise ProduceError(f"no acknowledgement from the broker within {timeout:.1f}s")
        failures = [r for r in results if isinstance(r, KafkaError)]
        if failures:
            raise ProduceError(f"{len(failures)} of {len(messages)} not acknowledged: {failures[0].str()}")
        return [r for r in results if isinstance(r, Delivered)]

    def close(self, timeout: float = 5.0) -> None:
        self._producer.flush(timeout)
        self._closed.set()
        self._poller.join(1.0)


def quiet_admin(settings: CommonSettings) -> AdminClient:
    """An admin client that leaves reporting to its caller.

    librdkafka logs every failed connection attempt to stderr (dozens of lines while a
    broker is down); the caller turns the one exception it gets into one line instead.
    """
    return AdminClient({**settings.kafka_client_options(), "log_level": 0})


def end_offsets(admin: AdminClient, topic: str, timeout: float) -> dict[int, int]:
    """Each partition of ``topic`` and its high watermark (the offset the next message gets).

    Two requests (metadata, then one ListOffsets for every partition), each bounded by
    ``timeout``; raises KafkaException if the broker does not answer in time or the topic
    does not exist. Metadata of all topics is asked for: naming the topic would let a broker
    that auto-creates topics create it.
    """
    deadline = time.monotonic() + timeout
    found = admin.list_topics(timeout=timeout).topics.get(topic)
    if found is None or found.error is not None:
        raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"no topic {topic}"))
    left = max(0.05, deadline - time.monotonic())
    requests = {TopicPartition(topic, p): OffsetSpec.latest() for p in found.partitions}
    futures = admin.list_offsets(requests, request_timeout=left) if requests else {}
    return {tp.partition: future.result(left + 1.0).offset for tp, future in futures.items()}


class TopicError(VigilError):
    """The topics cannot be created as the settings ask (the message names the setting)."""


def ensure_topics(
    settings: CommonSettings,
    topics: dict[str, int],
    replication: int | None = None,
    timeout: float = 30.0,
    configs: dict[str, dict[str, str]] | None = None,
) -> list[str]:
    """Create missing topics (name -> partitions); return the names created.

    Replication comes from ``VIGIL_TOPIC_REPLICATION`` unless given, with
    ``min.insync.replicas`` from the settings; ``configs`` adds topic settings per name.
    Existing topics are left as they are (:mod:`vigil.bus.topics` reports how they differ).
    A replication factor above the cluster's broker count is refused here, before the
    broker's own less specific error.
    """
    replication = settings.topic_replication if replication is None else replication
    admin = quiet_admin(settings)
    metadata = admin.list_topics(timeout=timeout)
    existing = metadata.topics
    missing = {name: count for name, count in topics.items() if name not in existing}
    if not missing:
        return []
    if replication > len(metadata.brokers):
        raise TopicError(
            f"VIGIL_TOPIC_REPLICATION={replication} is more than the {len(metadata.brokers)} broker(s) "
            f"at {settings.kafka_bootstrap}: cannot create {', '.join(missing)}"
        )
    insync = str(min(settings.min_insync_replicas, replication))
    wanted = [
        NewTopic(
            name,
            num_partitions=count,
            replication_factor=replication,
            config={"min.insync.replicas": insync, **(configs or {}).get(name, {})},
        )
        for name, count in missing.items()
    ]
    for _name, future in admin.create_topics(wanted, operation_timeout=timeout).items():
        try:
            future.result(timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # Metadata for new topics reaches every client asynchronously; wait until it is visible
    # so a consumer subscribing right after sees all partitions.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = admin.list_topics(timeout=timeout).topics
        if all(name in seen and len(seen[name].partitions) == count for name, count in topics.items()):
            break
        time.sleep(0.1)
    return list(missing)
