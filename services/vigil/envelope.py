"""The event envelope every producer writes (schema ``vigil.v1.Event``), as a Python value.

Its own module, below both the bus (which encodes it, :mod:`vigil.bus.codec`) and the ledger
(which builds the approval events, :mod:`vigil.ledger.approvals`), so that neither imports
the other (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, overload


@dataclass(frozen=True, slots=True)
class Event:
    """The envelope every producer writes (schema ``vigil.v1.Event``)."""

    user_id: str
    source: str
    source_id: str
    kind: str
    payload: str
    received_at: datetime
    occurred_at: datetime | None = None
    session_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "user_id": self.user_id,
            "source": self.source,
            "source_id": self.source_id,
            "kind": self.kind,
            "occurred_at": self.occurred_at,
            "received_at": self.received_at,
            "payload": self.payload,
            "session_id": self.session_id,
            "headers": dict(self.headers),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Event:
        return cls(
            user_id=record["user_id"],
            source=record["source"],
            source_id=record["source_id"],
            kind=record["kind"],
            payload=record["payload"],
            received_at=aware(record["received_at"]),
            occurred_at=aware(record.get("occurred_at")),
            session_id=record.get("session_id"),
            headers=dict(record.get("headers") or {}),
        )

    def payload_json(self) -> Any:
        return json.loads(self.payload)


@overload
def aware(value: datetime) -> datetime: ...
@overload
def aware(value: None) -> None: ...
def aware(value: datetime | None) -> datetime | None:
    """``value``, in UTC when it carries no zone of its own."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
