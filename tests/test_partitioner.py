"""vigil's keys land where the Java client would put them.

The vectors below were computed with Kafka's own ``org.apache.kafka.common.utils.Utils``
(kafka-clients 4.1.1: ``murmur2`` and ``toPositive(h) % 12``), not with vigil's code; the
first six are also the ones in Kafka's ``UtilsTest``.
"""

from __future__ import annotations

from datetime import UTC

import pytest

from vigil.bus.kafka import EventProducer
from vigil.envelope import Event
from vigil.partitioner import java_partition, murmur2
from vigil.settings import CommonSettings

JAVA_VECTORS = [
    ("21", -973932308, 0),
    ("foobar", -790332482, 6),
    ("a-little-bit-long-string", -985981536, 8),
    ("a-little-bit-longer-string", -1486304829, 11),
    ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971, 5),
    ("abc", 479470107, 3),
    ("user-1", 1404122828, 8),
    ("user-42", 1459644460, 4),
    ("ユーザー", -1765709869, 7),
    ("", 275646681, 9),
    ("x", 2121525046, 10),
]


@pytest.mark.parametrize("key, hashed, partition", JAVA_VECTORS)
def test_murmur2_matches_java(key, hashed, partition):
    assert murmur2(key.encode()) == hashed
    assert java_partition(key.encode(), 12) == partition


@pytest.mark.partitions(12)
def test_producer_puts_keys_on_the_java_partition(stack, topics):
    from datetime import datetime

    settings = CommonSettings(kafka_bootstrap=stack.bootstrap, events_topic=topics.events)
    producer = EventProducer(settings)
    try:
        events = [
            Event(
                user_id=key,
                source="test",
                source_id=f"k{i}",
                kind="test",
                payload="{}",
                received_at=datetime.now(UTC),
            )
            for i, (key, _, _) in enumerate(JAVA_VECTORS)
            if key
        ]
        delivered = producer.send(events)
    finally:
        producer.close()
    for event, where in zip(events, delivered):
        assert where.partition == java_partition(event.user_id.encode(), 12), event.user_id
