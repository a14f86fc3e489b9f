"""Delivery channels: a signed webhook, a Kafka topic, the log.

A channel gets a :class:`Delivery` whose id and content were fixed in the ledger before the
call, and answers with an :class:`Outcome`: delivered, retry (with the receiver's
Retry-After if it gave one), or dead. A channel never raises for a receiver's failure, and
never touches the ledger: the loop records the outcome.

Every copy of a delivery carries the same bytes: the body is rendered only from what the
ledger stored (the rows, the delivery id, the time it was fixed), so a copy re-sent after a
crash is byte-identical and the receiver can drop it by id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import secrets
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import IO, Protocol
from uuid import UUID

import httpx

from vigil import tracing
from vigil.bus.codec import DELIVERY_SCHEMA_NAME, AvroCodec
from vigil.bus.kafka import EventProducer, Headers, ProduceError
from vigil.dispatcher.pacing import Row
from vigil.ledger.states import ChannelType
from vigil.outbound import AddressPolicy, BlockedAddress, guarded_transport, url_problem
from vigil.retry import retry_after_seconds

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # Standard Webhooks: 24 to 64 random bytes
SIGNATURE_VERSION = "v1"
DELIVERY_TYPE = "vigil.delivery"
JOIN_SEPARATOR = "\n\n"
# 408 is a timeout reported by the receiver's own front end: retried like one.
RETRIED_STATUSES = frozenset({408, 429})
# A receiver's answer is read up to this many bytes (then dropped): enough for any
# acknowledgement, and the bound on what a hostile receiver can make the dispatcher read.
MAX_ANSWER_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """A user's channel and pacing limits: their ``channels`` row, or the defaults."""

    type: ChannelType
    url: str | None = None
    secret: str | None = None
    gap_s: int | None = None  # None: VIGIL_OUTBOX_GAP
    urgent_cap: int | None = None  # None: VIGIL_URGENT_DAILY_CAP


LOG_CHANNEL = ChannelConfig(ChannelType.LOG)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivery as fixed in the ledger: the rows sharing ``delivery_id``, oldest first."""

    delivery_id: UUID
    user_id: str
    rows: tuple[Row, ...]
    attempt: int  # 1 for the first send; the fencing token of this attempt's outcome
    fixed_at: datetime
    channel: ChannelConfig

    @property
    def urgent(self) -> bool:
        return any(row.urgent for row in self.rows)

    @property
    def created_at(self) -> datetime:
        return min(row.created_at for row in self.rows)

    @property
    def session_id(self) -> str | None:
        """The conversation a reply to this delivery resumes: its newest message's that names one."""
        return next((row.session_id for row in reversed(self.rows) if row.session_id), None)

    @property
    def actions(self) -> list[dict]:
        """The answer actions of the approval questions among the rows (a chat app's buttons:
        each a signed, single-use ``POST`` URL valid until its ``expires_at``), oldest first."""
        return [action for row in self.rows for action in (row.actions or ())]

    def document(self) -> dict:
        """What the receiver gets (Standard Webhooks' recommended ``type/timestamp/data``)."""
        return {
            "type": DELIVERY_TYPE,
            "timestamp": self.fixed_at.isoformat(),
            "data": {
                "delivery_id": str(self.delivery_id),
                "user_id": self.user_id,
                "session_id": self.session_id,
                "urgent": self.urgent,
                "text": JOIN_SEPARATOR.join(row.body for row in self.rows),
                "actions": self.actions,
                "messages": [
                    {
                        "id": row.id,
                        "run_id": row.run_id,
                        "body": row.body,
                        "urgent": row.urgent,
                        "created_at": row.created_at.isoformat(),
                        "session_id": row.session_id,
                    }
                    for row in self.rows
                ],
            },
        }

    def body(self) -> bytes:
        return json.dumps(self.document(), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


class Result(StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Outcome:
    result: Result
    error: str | None = None
    retry_after_s: float | None = None


# -- Standard Webhooks signing ---------------------------------------------------------


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """``webhook-signature``: HMAC-SHA256 over ``id.timestamp.body``, base64, version-tagged."""
    mac = hmac.new(secret_key(secret), f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(mac).decode()}"


# -- channels ---------------------------------------------------------------------------


class Channel(Protocol):
    def send(self, delivery: Delivery, now: datetime) -> Outcome: ...

    def close(self) -> None: ...


class WebhookChannel:
    """HTTP POST, signed. 2xx delivered; 408, 429, 5xx, timeouts, refused connections are
    retried; any other answer (a 410 for a gone endpoint, a 3xx: redirects are not followed
    with a signed body) is final.

    Only the status and ``Retry-After`` of the answer are used: at most ``MAX_ANSWER_BYTES``
    of its body are read (and dropped), so a receiver answering 50 MB costs nothing. The
    target must pass ``policy`` (:mod:`vigil.outbound`): a refused address is dead at once.
    """

    def __init__(self, timeout_s: float, concurrency: int, policy: AddressPolicy | None = None):
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        transport = guarded_transport(policy or AddressPolicy(), limits=limits)
        self.client = httpx.Client(timeout=timeout_s, transport=transport, follow_redirects=False, trust_env=False)
        self.timeout_s = timeout_s

    def send(self, delivery: Delivery, now: datetime) -> Outcome:
        config = delivery.channel
        if not config.url or not config.secret:
            # (A sealed secret that does not open in its row is left out: the log names it.)
            return Outcome(Result.DEAD, "webhook channel without url or secret")
        problem = url_problem(config.url)
        if problem is not None:
            return Outcome(Result.DEAD, f"bad webhook url: {problem}")
        body = delivery.body()
        message_id = str(delivery.delivery_id)
        # The attempt's own time: receivers reject stale timestamps (replay protection), so
        # a retry hours later must not carry the first attempt's.
        timestamp = int(now.timestamp())
        headers = {
            "content-type": "application/json",
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(config.secret, message_id, timestamp, body),
            "user-agent": "vigil-dispatcher",
        }
        try:
            with self.client.stream("POST", config.url, content=body, headers=headers) as response:
                status = response.status_code
                retry_after = retry_after_seconds(response.headers, now.timestamp())
                # Read a small answer to its end so the connection is reused (a new
                # connection per delivery overflows small receivers' accept queues); stop
                # at the bound, and the connection is closed instead.
                read = 0
                for chunk in response.iter_raw():
                    read += len(chunk)
                    if read > MAX_ANSWER_BYTES:
                        break
        except httpx.TimeoutException:
            return Outcome(Result.RETRY, f"no answer within {self.timeout_s:g}s")
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            return Outcome(Result.DEAD, f"bad webhook url: {exc}")
        except httpx.ConnectError as exc:
            if isinstance(exc.__context__, BlockedAddress) or isinstance(exc.__cause__, BlockedAddress):
                # An operator must change the URL or the policy; retrying changes nothing.
                return Outcome(Result.DEAD, f"refused target: {exc}")
            return Outcome(Result.RETRY, f"{type(exc).__name__}: {exc}")
        except httpx.TransportError as exc:
            return Outcome(Result.RETRY, f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            return Outcome(Result.DELIVERED)
        error = f"HTTP {status}"
        if status in RETRIED_STATUSES or status >= 500:
            return Outcome(Result.RETRY, error, retry_after)
        return Outcome(Result.DEAD, f"{error} (not retried)")

    def close(self) -> None:
        self.client.close()


class KafkaChannel:
    """An Avro ``vigil.v1.Delivery`` record keyed by user, acknowledged by the broker."""

    def __init__(self, topic: str, make_producer: Callable[[], EventProducer], schema_registry_url: str | None = None):
        self.topic = topic
        self.codec = AvroCodec(DELIVERY_SCHEMA_NAME, schema_registry_url=schema_registry_url)
        self._make_producer = make_producer
        self._producer: EventProducer | None = None
        self._lock = threading.Lock()

    def producer(self) -> EventProducer:
        # Made on first use: a dispatcher whose users all have other channels opens no producer.
        with self._lock:
            if self._producer is None:
                self._producer = self._make_producer()
            return self._producer

    def record(self, delivery: Delivery) -> dict:
        return {
            "delivery_id": str(delivery.delivery_id),
            "user_id": delivery.user_id,
            "messages": [row.body for row in delivery.rows],
            "urgent": delivery.urgent,
            "created_at": delivery.created_at,
            # The fixed time, not the attempt's: every copy of a delivery is the same record.
            "sent_at": delivery.fixed_at,
            "session_id": delivery.session_id,
            "actions": delivery.actions,
        }

    def send(self, delivery: Delivery, now: datetime) -> Outcome:
        value = self.codec.encode_record(self.record(delivery), self.topic)
        headers: Headers = [("delivery-id", str(delivery.delivery_id).encode())]
        if tracing.enabled:  # the delivery span's context, for a consumer that traces too
            headers += tracing.kafka_headers(tracing.carrier()) or []
        try:
            self.producer().send_raw([(delivery.user_id.encode(), value)], self.topic, headers=headers)
        except ProduceError as exc:
            return Outcome(Result.RETRY, str(exc))
        return Outcome(Result.DELIVERED)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()


# An approval answer token (vigil.ledger.approvals.sign_token): "v1." and 43 base64url
# characters. Whoever holds one can answer the request, so a log line must not carry it.
APPROVAL_TOKEN = re.compile(r"\bv1\.[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")
REDACTED_TOKEN = "v1.[redacted]"


def redact(text: str) -> str:
    """``text`` with every approval answer token replaced by :data:`REDACTED_TOKEN`."""
    return APPROVAL_TOKEN.sub(REDACTED_TOKEN, text)


class LogChannel:
    """One JSON line per delivery on stdout (the demo's channel and the default).

    Approval answer tokens are redacted: a log file is read by more people than the
    addressee (and kept longer). The full message, token included, stays in the ledger's
    outbox row, where an operator who needs it reads it.
    """

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream
        self._lock = threading.Lock()

    def send(self, delivery: Delivery, now: datetime) -> Outcome:
        line = redact(json.dumps({"channel": "log", **delivery.document()}, sort_keys=True, ensure_ascii=False))
        stream = self.stream or sys.stdout
        try:
            with self._lock:
                stream.write(line + "\n")
                stream.flush()
        except OSError as exc:  # a closed or full stdout: the line may be lost, so retry
            return Outcome(Result.RETRY, f"log write failed: {exc}")
        return Outcome(Result.DELIVERED)

    def close(self) -> None:
        return None


class Channels:
    """The three channels of one dispatcher, chosen per delivery by its user's config."""

    def __init__(self, webhook: Channel, kafka: Channel, log_channel: Channel):
        self.by_type: dict[ChannelType, Channel] = {
            ChannelType.WEBHOOK: webhook,
            ChannelType.KAFKA: kafka,
            ChannelType.LOG: log_channel,
        }

    def send(self, delivery: Delivery, now: datetime) -> Outcome:
        try:
            return self.by_type[delivery.channel.type].send(delivery, now)
        except Exception as exc:  # a bug in a channel must cost one attempt, not the process
            log.exception("channel %s failed on delivery %s", delivery.channel.type, delivery.delivery_id)
            return Outcome(Result.RETRY, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        for channel in self.by_type.values():
            channel.close()
