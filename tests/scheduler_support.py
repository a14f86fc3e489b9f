"""Shared by the scheduler tests: reading what the scheduler produced, and standing in for
the worker's recording step where a test needs ledger semantics before a worker runs."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime

import psycopg
from confluent_kafka import Consumer, TopicPartition

from vigil.bus.codec import EventCodec
from vigil.envelope import Event

CODEC = EventCodec()
DAY = 86_400


def utc(*fields: int) -> int:
    return int(datetime(*fields, tzinfo=UTC).timestamp())


def topic_size(bootstrap: str, topic: str) -> int:
    """Messages on the topic: the sum of its partitions' high watermarks (exact: the
    scheduler's producer is idempotent and every send it commits after was acknowledged)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"size-{uuid.uuid4().hex}"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions)
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str, timeout: float = 30.0) -> list[Event]:
    """Every event on the topic now, in partition order; fails if they cannot all be read."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {}
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = (low, high)
        consumer.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
        events: list[Event] = []
        remaining = sum(high - low for low, high in ends.values())
        deadline = time.monotonic() + timeout
        while remaining and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            event = CODEC.decode(message.value())
            assert message.key() == event.user_id.encode(), "the Kafka key must be the user id"
            events.append(event)
            remaining -= 1
        assert remaining == 0, f"{remaining} message(s) of {topic} not read within {timeout:.0f}s"
        return events
    finally:
        consumer.close()


def record(dsn: str, events: list[Event]) -> int:
    """What the worker's recording step does: insert each event, duplicates dropped by the
    ledger's dedup key (the primary key of event_keys). Returns the rows that were new."""
    with psycopg.connect(dsn) as conn:
        new = 0
        for event in events:
            cursor = conn.execute(
                "WITH k AS (INSERT INTO event_keys (user_id, source, source_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING 1) "
                "INSERT INTO events (user_id, source, source_id, kind, payload, received_at) "
                "SELECT %s, %s, %s, %s, %s, %s FROM k",
                (event.user_id, event.source, event.source_id)
                + (event.user_id, event.source, event.source_id, event.kind, event.payload, event.received_at),
            )
            new += cursor.rowcount
        return new


def bodies(events: list[Event]) -> list[dict]:
    return [json.loads(event.payload) for event in events]
