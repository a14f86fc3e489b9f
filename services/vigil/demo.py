"""``vigil demo``: show the running stack working, step by step, against real services.

Each step prints what it did and what came back; a step that cannot pass says why and the
command exits non-zero, so ``make up`` ends in a visible failure rather than a silent one.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone

import click
from confluent_kafka import Consumer, TopicPartition

from vigil.bus.codec import Event, EventCodec
from vigil.bus.kafka import EventProducer
from vigil.ledger.db import connect
from vigil.ledger.queries import Q
from vigil.service import load_or_exit
from vigil.settings import CommonSettings


class DemoFailed(click.ClickException):
    pass


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")


def step_broker_round_trip(settings: CommonSettings, event: Event) -> None:
    """An event produced to the events topic and read back from the partition it landed on."""
    producer = EventProducer(settings)
    try:
        [where] = producer.send([event])
    finally:
        producer.close()
    click.echo(f"  produced {event.kind} for {event.user_id} -> {where.topic}[{where.partition}] offset {where.offset} (acks=all)")
    consumer = Consumer({**settings.kafka_client_options(), "group.id": f"vigil-demo-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(where.topic, where.partition, where.offset)])
        message = _wait(lambda: _poll_ok(consumer), 20, "the event to be read back")
        decoded = EventCodec(settings.schema_registry_url).decode(message.value())
        assert decoded.source_id == event.source_id
        click.echo(f"  read back from the broker: key={message.key().decode()} payload={decoded.payload}")
    finally:
        consumer.close()


def _poll_ok(consumer):
    message = consumer.poll(0.5)
    return message if message is not None and not message.error() else None


def step_recorded_and_answered(settings: CommonSettings, event: Event) -> str:
    with connect(settings.dsn, autocommit=True) as conn:
        row = _wait(
            lambda: conn.execute(
                Q.demo_event_by_key, {"user_id": event.user_id, "source": event.source, "source_id": event.source_id}
            ).fetchone(),
            30,
            "the worker to record the event",
        )
        click.echo(f"  recorded in the ledger as event {row['id']} ({row['status']})")
        done = _wait(
            lambda: conn.execute(Q.demo_event_done, {"id": row["id"]}).fetchone(),
            30,
            "the run to finish",
        )
        reply = conn.execute(Q.demo_run_reply, {"run_id": done["run_id"]}).fetchone()
        click.echo(f"  run {done['run_id']} finished; outbox row {reply['id'] if reply else '-'}: {reply['body'] if reply else '(nothing to say)'!r}")
        if reply is None:
            return ""
        delivered = _wait(
            lambda: conn.execute(Q.demo_outbox_delivered, {"id": reply["id"]}).fetchone(),
            30,
            "the dispatcher to deliver the reply",
        )
        click.echo(f"  delivered by the dispatcher (delivery id {delivered['delivery_id']})")
        return reply["body"]


@click.command()
def demo() -> None:
    """Show the running stack at work: an event in, recorded, answered, delivered."""
    settings = load_or_exit(CommonSettings)
    # A fresh user per run: the outbox pacing gap (an hour by default) would hold a second
    # demo's reply for the same user.
    user = f"demo-{uuid.uuid4().hex[:6]}"
    event = Event(
        user_id=user,
        source="chat",
        source_id=f"demo-{uuid.uuid4().hex[:12]}",
        kind="chat.message",
        payload=json.dumps({"text": "hello vigil"}),
        received_at=datetime.now(timezone.utc),
    )
    click.echo("1. an event through the real broker")
    step_broker_round_trip(settings, event)
    click.echo("2. recorded by a worker, answered by the agent, delivered on the user's channel")
    step_recorded_and_answered(settings, event)
    click.echo("demo: ok")


commands = [demo]
