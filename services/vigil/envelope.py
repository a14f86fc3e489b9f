"""The event envelope every producer writes (schema ``vigil.v1.Event``), as a Python value.

Its own module, below both the bus (which encodes it, :mod:`vigil.bus.codec`) and the ledger
(which builds the approval events, :mod:`vigil.ledger.approvals`), so that neither imports
the other (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, overload

MAX_USER_ID_CHARS = 256  # every route, command and topic key: one length (issue 58)


def id_problem(value: str, max_chars: int | None = MAX_USER_ID_CHARS) -> str | None:
    """Why ``value`` cannot be an id (a user id, a source, a source id, a kind), or None.

    The one rule of every route and command (issue 58): 1 to ``max_chars`` characters, all
    printable (no control character, NUL or lone surrogate: ids become Kafka keys, ledger text
    and an operator's terminal lines), and no space at either end, so ``" b1"`` and ``"b1 "``
    cannot pass for ``b1`` in the console, and an id of spaces is no id."""
    if not value:
        return "must not be empty"
    if max_chars is not None and len(value) > max_chars:
        return f"must be at most {max_chars} characters"
    if not value.isprintable():
        return "must be printable characters (no control character, NUL or lone surrogate)"
    if value != value.strip():
        return "must not begin or end with a space"
    return None


def folded(name: str) -> str:
    """``name`` as a reserved name is compared: NFKC (fullwidth ``ｔｉｍｅｒ`` is ``timer``),
    case-folded and trimmed, so ``Timer`` or ``timer `` cannot pass for a reserved source."""
    return unicodedata.normalize("NFKC", name).casefold().strip()


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
