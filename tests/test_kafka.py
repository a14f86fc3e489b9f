"""A real event through the real broker, and proof the broker is Apache Kafka."""

from __future__ import annotations

from datetime import UTC, datetime

from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from vigil.bus.codec import EventCodec
from vigil.bus.kafka import EventProducer
from vigil.envelope import Event
from vigil.settings import CommonSettings


def test_produce_and_consume_a_real_event(stack, topics):
    settings = CommonSettings(kafka_bootstrap=stack.bootstrap, events_topic=topics.events)
    event = Event(
        user_id="user-7",
        source="chat",
        source_id="m-1",
        kind="chat.message",
        payload='{"text": "hello"}',
        received_at=datetime.now(UTC).replace(microsecond=0),
    )
    producer = EventProducer(settings)
    try:
        [where] = producer.send([event])
    finally:
        producer.close()
    consumer = Consumer(
        {"bootstrap.servers": stack.bootstrap, "group.id": f"{topics.events}.read", "auto.offset.reset": "earliest"}
    )
    try:
        consumer.subscribe([topics.events])
        message = None
        for _ in range(60):
            message = consumer.poll(1.0)
            if message is not None and not message.error():
                break
        assert message is not None and not message.error()
        assert message.key() == b"user-7"
        assert (message.partition(), message.offset()) == (where.partition, where.offset)
        assert EventCodec().decode(message.value()) == event
    finally:
        consumer.close()


def test_the_broker_is_apache_kafka(stack):
    """ApiVersions answers, and (when this session started it) the process is kafka.Kafka."""
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    metadata = admin.list_topics(timeout=10)
    assert metadata.brokers, "no broker in metadata"
    cluster = admin.describe_cluster().result(10)
    assert cluster.cluster_id
    if stack.kafka is not None:
        pid = int(stack.kafka.pidfile.read_text())
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert b"kafka.Kafka" in cmdline
        assert any(part.endswith(b"*") and b"libs" in part for part in cmdline)
        jars = [p.name for p in stack.kafka.libs.glob("kafka_2.13-*.jar")]
        assert jars and jars[0].startswith("kafka_2.13-4.")
