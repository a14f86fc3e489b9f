"""``POST /v1/events`` (the producer API) and ``POST /v1/users/{user_id}/messages`` (chat).

Both need a bearer token, validate everything before producing anything (one bad event in a
batch refuses the whole batch, naming ``events[i].field``), and answer 202 only after the
broker acknowledged every event.

Sources that ingest itself vouches for (webhook providers, ``timer``, ``approval``) cannot
be written through the producer API: a token holder could otherwise take a provider's
delivery id, or forge an approval wake-up, before the real one arrives. ``chat`` can: the
chat endpoint takes the same tokens and any Idempotency-Key, so a chat event produced
through ``/v1/events`` (with its ``session_id``, to continue a conversation) vouches for
nothing more.

A chat message continues a conversation when it names one: ``session_id`` directly (a
session of that user: another user's is a 404, as is their delivery), or ``in_reply_to``,
the id of the delivery it answers, which ingest resolves to the session that wrote that
delivery (:func:`EventsApi.reply_session`). Neither: today's rules (the message joins
whatever the run resumes anyway, or starts a new session).

A message continuing a session that waits on an approval, whose text is a clear yes or no
(:func:`vigil.ingest.replies.clear_answer`), answers that approval instead of being
produced (:meth:`vigil.ingest.approvals_api.ApprovalsApi.answer_reply`: the API's rule,
statuses and wake-up). An unclear reply is produced as a message, and reaches the agent.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Annotated, Any

import psycopg
from psycopg.rows import DictRow
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vigil.envelope import MAX_USER_ID_CHARS, Event, folded, id_problem
from vigil.ingest.auth import TokenAuth, authorize
from vigil.ingest.publisher import Publisher
from vigil.ingest.replies import clear_answer
from vigil.ingest.requests import Refusal, invalid, read_json, received_at
from vigil.ingest.settings import IngestSettings
from vigil.ledger import agent, outbox
from vigil.ledger.states import ApprovalAnswer, HookProvider, Scope
from vigil.numbers import event_instant_problem, instant

# A chat reply's clear answer (user, session, answer, arrival, the message's source_id, the
# delivery it names): the response to give, or None when it answers no request
# (ApprovalsApi.answer_reply).
AnswerReply = Callable[[str, str, ApprovalAnswer, datetime, str, uuid.UUID | None], Awaitable[Response | None]]
# A pooled connection in one transaction on a user's ledger shard (IngestContext.ledger).
UserLedger = Callable[[str], AbstractAsyncContextManager[psycopg.AsyncConnection[DictRow]]]

CHAT_SOURCE = "chat"
CHAT_KIND = "chat.message"
RESERVED_SOURCES = frozenset({"timer", "approval", *(p.value for p in HookProvider)})
MAX_TEXT_CHARS = 100_000
MAX_IDEMPOTENCY_KEY_CHARS = 255
# Avro's timestamp-millis counts from 1970 in a signed long, so any year from 1 fits; the
# ledger's timestamptz too. Year 1 in UTC is where Python's datetime ends.
MIN_YEAR = 1
# json.dumps with options builds a new encoder per call; the payload is re-encoded for every event.
PAYLOAD_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _one_id_rule(value: str) -> str:
    # vigil.envelope's rule for every id (its length is the field's): Kafka keys, ledger text
    # and JSON keys, where a NUL, a newline or an edge space would break or deceive.
    problem = id_problem(value, None)
    if problem is not None:
        raise ValueError(problem)
    return value


def _in_range(value: datetime) -> datetime:
    # 9999-12-31T23:59:59-23:59 is a valid RFC 3339 time whose UTC instant is in year
    # 10000: no datetime, Avro timestamp or ledger column downstream can carry it.
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise ValueError("must lie between years 1 and 9999 in UTC") from None
    if utc.year < MIN_YEAR:
        raise ValueError(f"must lie between years {MIN_YEAR} and 9999 in UTC")
    return value


def _instant(value: Any) -> Any:
    # vigil.numbers' one parser, before pydantic's: pydantic would read a bare number above
    # 2e10 as milliseconds (253402300800 became 1978) and take ISO 8601 forms RFC 3339 has not.
    return value if isinstance(value, datetime) else instant(value)


Instant = Annotated[AwareDatetime, BeforeValidator(_instant), AfterValidator(_in_range)]


def _id(max_length: int):
    return Annotated[str, Field(min_length=1, max_length=max_length), AfterValidator(_one_id_rule)]


class EventIn(BaseModel):
    """One event envelope as a producer sends it over HTTP (``vigil.v1.Event`` in JSON)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    user_id: _id(MAX_USER_ID_CHARS) = Field(description="Whose agent wakes; also the Kafka key.")
    source: _id(64) = Field(
        description="The producer's name. chat, timer, approval and webhook providers are reserved."
    )
    source_id: _id(512) = Field(
        description="The source's unique id of this event: the dedup key within (user_id, source)."
    )
    kind: _id(128) = Field(description="What happened, e.g. billing.invoice_paid.")
    payload: JsonValue = Field(default_factory=dict, description="The event body (any JSON value; default {}).")
    occurred_at: Instant | None = Field(
        None, description="When it happened at the source: RFC 3339 with an offset, or Unix seconds."
    )
    received_at: Instant | None = Field(
        None, description="When the producer received it (RFC 3339 or Unix seconds); default: when ingest did."
    )
    session_id: _id(256) | None = Field(None, description="Resume this saved agent session.")
    headers: dict[_id(128), Annotated[str, Field(max_length=4096), AfterValidator(_one_id_rule)]] = Field(
        default_factory=dict, max_length=32, description="Trace context and other metadata."
    )

    def event(self, arrived: datetime) -> Event:
        return Event(
            user_id=self.user_id,
            source=self.source,
            source_id=self.source_id,
            kind=self.kind,
            payload=PAYLOAD_ENCODER.encode(self.payload),
            received_at=self.received_at or arrived,
            occurred_at=self.occurred_at,
            session_id=self.session_id,
            headers=dict(self.headers),
        )


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    events: list[EventIn] = Field(min_length=1, description="Up to VIGIL_INGEST_MAX_BATCH events.")


class MessageIn(BaseModel):
    """A chat message from the user to their agent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, description="The message, any Unicode.")
    in_reply_to: uuid.UUID | None = Field(
        None, description="The delivery_id this message answers: the agent continues that delivery's conversation."
    )
    session_id: _id(256) | None = Field(
        None, description="Continue this agent session, one of this user's (instead of in_reply_to)."
    )


class Accepted(BaseModel):
    accepted: int = Field(description="Events the broker acknowledged (a batch's repeats counted once).")
    duplicates: int | None = Field(
        None,
        description="A batch: events dropped as repeats of an earlier one (same user_id, source, source_id).",
    )
    source_id: str | None = Field(
        None, description="The dedup key used (messages: the Idempotency-Key or a fresh uuid)."
    )
    session_id: str | None = Field(
        None, description="Messages: the session the message continues (given, or resolved from in_reply_to)."
    )


def field_path(loc: tuple[Any, ...]) -> str:
    """``('events', 3, 'user_id')`` -> ``events[3].user_id``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


def refuse_validation(exc: ValidationError, prefix: tuple = ()) -> Refusal:
    error = exc.errors(include_url=False, include_input=False)[0]
    return invalid(field_path(prefix + tuple(error["loc"])), error["msg"], code="invalid_event")


def parse_events(document: Any, max_batch: int, arrived: datetime) -> list[EventIn]:
    """The envelopes of a body, each valid and with its instants inside the event window at
    ``arrived`` (:func:`vigil.numbers.event_instant_problem`); else a 400 naming the field."""
    if not isinstance(document, dict):
        raise invalid("body", 'expected an event object or {"events": [...]}', code="invalid_event")
    if "events" in document:
        raw = document["events"]
        if isinstance(raw, list) and len(raw) > max_batch:
            raise invalid("events", f"{len(raw)} events; at most {max_batch} per request", code="invalid_event")
        try:
            envelopes = BatchIn.model_validate(document).events
        except ValidationError as exc:
            raise refuse_validation(exc) from None
        prefix: tuple = ("events",)
    else:
        try:
            envelopes = [EventIn.model_validate(document)]
        except ValidationError as exc:
            raise refuse_validation(exc) from None
        prefix = ()
    for index, envelope in enumerate(envelopes):
        if folded(envelope.source) in RESERVED_SOURCES:  # "Timer", "timer ", "ｔｉｍｅｒ" too
            where = field_path(prefix + ((index,) if prefix else ()) + ("source",))
            raise invalid(where, f"{envelope.source!r} is reserved for ingest's own endpoints", code="invalid_event")
        for name in ("occurred_at", "received_at"):
            value = getattr(envelope, name)
            problem = None if value is None else event_instant_problem(value, arrived)
            if problem is not None:
                where = field_path(prefix + ((index,) if prefix else ()) + (name,))
                raise invalid(where, problem, code="invalid_event")
    return envelopes


class EventsApi:
    def __init__(
        self,
        settings: IngestSettings,
        auth: TokenAuth,
        publisher: Publisher,
        user_ledger: UserLedger,
        answer_reply: AnswerReply | None = None,
    ):
        self.settings = settings
        self.auth = auth
        self.publisher = publisher
        self.user_ledger = user_ledger  # session and in_reply_to lookups, on the user's shard
        self.answer_reply = answer_reply

    async def reply_session(self, user_id: str, message: MessageIn) -> str | None:
        """The session a message continues: its ``session_id`` (404 if this user has no such
        session, as for a delivery: another user's is not theirs to continue), or the one that
        wrote the delivery it replies to (404 if this user had no such delivery; None if that
        delivery came from no session, e.g. the echo agent's)."""
        if message.in_reply_to is None:
            if message.session_id is not None:
                async with self.user_ledger(user_id) as conn:
                    found = await agent.has_session(conn, user_id=user_id, session_id=message.session_id)
                if not found:
                    raise Refusal(
                        404,
                        "unknown_session",
                        f"session_id: no session {message.session_id} of user {user_id}",
                        field="session_id",
                    )
            return message.session_id
        if message.session_id is not None:
            raise invalid("in_reply_to", "give in_reply_to or session_id, not both")
        async with self.user_ledger(user_id) as conn:
            row = await outbox.delivery_session(conn, user_id, message.in_reply_to)
        if row is None:
            raise Refusal(
                404,
                "unknown_delivery",
                f"in_reply_to: no delivery {message.in_reply_to} to user {user_id}",
                field="in_reply_to",
            )
        return row.session_id

    async def post_events(self, request: Request) -> Response:
        caller = await self.auth(request, Scope.EVENTS)
        document = await read_json(request, self.settings.max_body_bytes, "invalid_event")  # type: ignore[arg-type]  # set when validated
        arrived = received_at(request)
        envelopes = parse_events(document, self.settings.ingest_max_batch, arrived)
        if caller.users is not None:  # a token for some users: every event must be for one of them
            batch = "events" in document
            for index, envelope in enumerate(envelopes):
                authorize(caller, Scope.EVENTS, envelope.user_id, f"events[{index}].user_id" if batch else "user_id")
        await self.check_sessions(envelopes, "events" in document)
        # One event per (user_id, source, source_id), the first: the ledger stores one, so
        # the answer counts one and says how many repeats it dropped (issue 58).
        unique: dict[tuple[str, str, str], EventIn] = {}
        for envelope in envelopes:
            unique.setdefault((envelope.user_id, envelope.source, envelope.source_id), envelope)
        delivered = await self.publisher.send([envelope.event(arrived) for envelope in unique.values()], via="events")
        # The body JSONResponse would render, without its json.dumps: this is the hot path.
        repeats = len(envelopes) - len(unique)
        body = (
            b'{"accepted":%d,"duplicates":%d}' % (len(delivered), repeats)
            if repeats
            else b'{"accepted":%d}' % len(delivered)
        )
        return Response(body, 202, media_type="application/json")

    async def check_sessions(self, envelopes: list[EventIn], batch: bool) -> None:
        """A ``session_id`` must be one of the event's user's sessions: 404, as the messages
        route answers (another user's session is not theirs to wake; issue 58)."""
        seen: set[tuple[str, str]] = set()
        for index, envelope in enumerate(envelopes):
            if envelope.session_id is None or (envelope.user_id, envelope.session_id) in seen:
                continue
            async with self.user_ledger(envelope.user_id) as conn:
                found = await agent.has_session(conn, user_id=envelope.user_id, session_id=envelope.session_id)
            if not found:
                where = f"events[{index}].session_id" if batch else "session_id"
                raise Refusal(
                    404,
                    "unknown_session",
                    f"{where}: no session {envelope.session_id} of user {envelope.user_id}",
                    field=where,
                )
            seen.add((envelope.user_id, envelope.session_id))

    async def post_message(self, request: Request) -> Response:
        caller = await self.auth(request)
        user_id = request.path_params["user_id"]
        problem = id_problem(user_id)
        if problem is not None:
            raise invalid("user_id", problem)
        authorize(caller, Scope.MESSAGES, user_id)
        key = request.headers.get("idempotency-key")
        # ASCII only: header bytes arrive as latin-1, so a UTF-8 key would be stored as mojibake.
        if key is not None and not (0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS and key.isascii() and key.isprintable()):
            raise invalid("Idempotency-Key", f"1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters")
        try:
            message = MessageIn.model_validate(await read_json(request, self.settings.max_body_bytes, "invalid_event"))  # type: ignore[arg-type]
        except ValidationError as exc:
            raise refuse_validation(exc) from None
        session_id = await self.reply_session(user_id, message)
        source_id = key or str(uuid.uuid4())
        given = clear_answer(message.text) if session_id is not None and self.answer_reply else None
        if given is not None and session_id is not None and self.answer_reply is not None:
            answered = await self.answer_reply(
                user_id, session_id, given, received_at(request), source_id, message.in_reply_to
            )
            if answered is not None:
                return answered
        event = Event(
            user_id=user_id,
            source=CHAT_SOURCE,
            source_id=source_id,
            kind=CHAT_KIND,
            payload=json.dumps({"text": message.text}, ensure_ascii=False),
            received_at=received_at(request),
            session_id=session_id,
        )
        await self.publisher.send([event], via="messages")
        return JSONResponse({"accepted": 1, "source_id": source_id, "session_id": session_id}, 202)
