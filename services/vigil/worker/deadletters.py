"""The dead-letter topic: undecodable messages and dead events, the reason in headers.

Operators read it (and `vigil dead list`) to see what vigil could not process; nothing on it
is retried automatically. A dead-letter record is produced and acknowledged *before* the
offset of an undecodable message is stored, so a crash in between re-reads the message and
produces the record again rather than losing it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from confluent_kafka import Message

from vigil.bus.kafka import EventProducer, Headers, ProduceError
from vigil.envelope import Event
from vigil.ledger.claims import DeadEvent
from vigil.settings import CommonSettings

log = logging.getLogger(__name__)


class DeadLetters:
    def __init__(self, settings: CommonSettings, producer: EventProducer) -> None:
        self.topic = settings.dlq_topic
        self.producer = producer
        self.codec = producer.codec

    def publish_undecodable(self, messages: list[tuple[Message, str]]) -> None:
        """``(kafka message, reason)`` pairs, copied verbatim. Raises ProduceError."""
        for message, reason in messages:
            headers: Headers = [
                ("vigil-error", reason.encode()[:1000]),
                ("vigil-stage", b"decode"),
                ("vigil-origin-topic", str(message.topic()).encode()),
                ("vigil-origin-partition", str(message.partition()).encode()),
                ("vigil-origin-offset", str(message.offset()).encode()),
            ]
            self.producer.send_raw([(message.key(), message.value() or b"")], self.topic, headers=headers)

    def publish_dead(self, rows: list[DeadEvent]) -> None:
        """Events that exhausted their attempts. Best effort: the ledger row is the record."""
        for row in rows:
            event = Event(
                user_id=row.user_id,
                source=row.source,
                source_id=row.source_id,
                kind=row.kind,
                payload=row.payload,
                received_at=row.received_at or datetime.now(UTC),
                occurred_at=row.occurred_at,
                session_id=row.session_id,
            )
            headers: Headers = [
                ("vigil-error", (row.error or "attempts exhausted").encode()[:1000]),
                ("vigil-stage", b"run"),
                ("vigil-event-id", str(row.id).encode()),
            ]
            try:
                self.producer.send_raw(
                    [(event.user_id.encode(), self.codec.encode(event, self.topic))], self.topic, headers=headers
                )
            except ProduceError as exc:
                log.error("dead event %d not copied to %s (it stays dead in the ledger): %s", row.id, self.topic, exc)
