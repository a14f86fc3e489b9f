"""Settings of `vigil ingest`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, SecretStr, model_validator

from vigil.httpserver import ServerLimits
from vigil.settings import DEFAULT_INGEST_PORT, CommonSettings

# One produce request's worth of events; a caller with more splits them (and gets a precise
# 400 telling it so rather than a slow request that times out half-way).
DEFAULT_MAX_BATCH_EVENTS = 500
# How stale a cached token or hook may be. Revoking a token or a hook secret takes effect
# within this bound on every replica, without a database round trip on every request.
DEFAULT_AUTH_CACHE_S = 5.0
# Stripe's and Standard Webhooks' documented tolerance: a captured delivery replayed later
# than this is refused even with a valid signature.
DEFAULT_WEBHOOK_TOLERANCE_S = 300
DEFAULT_DB_POOL_SIZE = 8
# librdkafka's own default for message.max.bytes, below the broker's default (1,048,588):
# the largest event the producer will send. Set explicitly so the body bound derives from it.
DEFAULT_KAFKA_MESSAGE_MAX_BYTES = 1_000_000
# Room in one Kafka message for what is not the request body: the Avro envelope (ids,
# times, the user id again as the key) and the record's own framing. The envelope's text
# fields come from the body itself, so a few KiB would do; 16 KiB leaves a wide margin.
ENVELOPE_RESERVE_BYTES = 16 * 1024
SERVER = ServerLimits()
# Far above what one well-behaved producer sends to one process (the benchmark's single
# token peaks near 1,500 requests/s), low enough that one leaked token cannot take a
# process's whole capacity.
DEFAULT_TOKEN_RATE = 5000.0
DEFAULT_TOKEN_BURST = 10_000
# A person's agent needs a few dozen timers; thousands is a runaway loop or an abuse.
DEFAULT_MAX_TIMERS_PER_USER = 1000
# One token acts for many users (a backend's), but each user id in a path is the caller's to
# invent: without a bound per token, one token holds 1,000 timers for every id it makes up.
DEFAULT_TIMER_QUOTA_PER_TOKEN = 100_000
# An agent woken every second is a busy loop, not a schedule.
DEFAULT_MIN_TIMER_EVERY_S = 60


class IngestSettings(CommonSettings):
    service_name: ClassVar[str] = "ingest"

    ingest_port: int = Field(
        DEFAULT_INGEST_PORT, ge=1, le=65535, description="HTTP port of ingest (API, /healthz, /readyz, /metrics)."
    )
    ingest_host: str = Field("0.0.0.0", description="Address ingest listens on.")
    # Required here (optional for services that never verify a token): ingest without it
    # could not tell a real approval from a forged one, so it must not start.
    approval_secret: SecretStr = Field(
        description="Key that signs approval answer tokens (ingest verifies, worker signs). "
        "Required by ingest and worker; `make up` generates one. Never logged.",
    )
    kafka_message_max_bytes: int = Field(
        DEFAULT_KAFKA_MESSAGE_MAX_BYTES,
        ge=64 * 1024,
        le=100 * 1024 * 1024,
        description="Largest Kafka message ingest produces (librdkafka `message.max.bytes`); keep it at or below "
        "the broker's and the topic's `max.message.bytes`. `VIGIL_MAX_BODY_BYTES` is derived from it.",
    )
    max_body_bytes: int | None = Field(
        None,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest request body ingest accepts; larger is refused with 413 before it is read whole. "
        "Default and upper bound: `VIGIL_KAFKA_MESSAGE_MAX_BYTES` less 16 KiB for the event envelope, so an "
        "accepted body always fits one Kafka message (checked at start-up).",
    )
    ingest_max_batch: int = Field(
        DEFAULT_MAX_BATCH_EVENTS,
        ge=1,
        le=10_000,
        description='Most events one `POST /v1/events` may carry in `{"events": [...]}`.',
    )
    ingest_auth_cache_s: float = Field(
        DEFAULT_AUTH_CACHE_S,
        ge=0,
        le=300,
        description="Seconds ingest caches API tokens and hook secrets: a revocation takes effect "
        "within this bound (0: look up on every request).",
    )
    webhook_tolerance_s: int = Field(
        DEFAULT_WEBHOOK_TOLERANCE_S,
        ge=1,
        le=3600,
        description="Largest clock difference accepted in a signed webhook timestamp (Stripe, Standard Webhooks).",
    )
    ingest_db_pool: int = Field(
        DEFAULT_DB_POOL_SIZE, ge=1, le=200, description="Most ledger connections one ingest process holds."
    )
    ingest_token_rate: float = Field(
        DEFAULT_TOKEN_RATE,
        ge=0,
        le=1_000_000,
        description="Requests a second one API token may make to one ingest process (429 with Retry-After "
        "past it; 0: no limit).",
    )
    ingest_token_burst: int = Field(
        DEFAULT_TOKEN_BURST, ge=1, le=10_000_000, description="Requests one API token may make at once above its rate."
    )
    max_timers_per_user: int = Field(
        DEFAULT_MAX_TIMERS_PER_USER,
        ge=1,
        le=10_000_000,
        description="Most live timers one user may have through the timers API (a new one past it is 429).",
    )
    timer_quota_per_token: int = Field(
        DEFAULT_TIMER_QUOTA_PER_TOKEN,
        ge=1,
        le=100_000_000,
        description="Most live timers one API token may have created or last registered, over all users "
        "(a new one past it is 429).",
    )
    min_timer_every_s: int = Field(
        DEFAULT_MIN_TIMER_EVERY_S,
        ge=1,
        le=86_400,
        description="Shortest `every` the timers API accepts for a recurring timer, in seconds.",
    )
    ingest_max_header_bytes: int = Field(
        SERVER.max_head_bytes,
        ge=1024,
        le=1024 * 1024,
        description="Largest request line plus headers ingest reads; larger is refused with 431 while it arrives.",
    )
    ingest_header_timeout_s: float = Field(
        SERVER.head_timeout_s,
        gt=0,
        le=300,
        description="Seconds a client has to send a request's line and headers (from connecting, or from the "
        "first byte of a later request); then 408 and the connection is closed.",
    )
    ingest_body_timeout_s: float = Field(
        SERVER.body_timeout_s,
        gt=0,
        le=3600,
        description="Seconds a client has to send a request's body after its headers; then 408 and closed.",
    )
    ingest_max_connections: int = Field(
        SERVER.max_connections,
        ge=1,
        le=100_000,
        description="Most open HTTP connections per ingest process; one more is answered 503 and closed.",
    )
    ingest_keep_alive_s: int = Field(
        SERVER.keep_alive_s, ge=1, le=300, description="Seconds an idle kept-alive connection stays open."
    )

    @model_validator(mode="after")
    def _body_fits_a_message(self) -> IngestSettings:
        bound = self.kafka_message_max_bytes - ENVELOPE_RESERVE_BYTES
        if self.max_body_bytes is None:
            object.__setattr__(self, "max_body_bytes", bound)  # frozen model: set once, here
        elif self.max_body_bytes > bound:
            # Otherwise a body in between is accepted, then refused by the producer: a 503
            # that no retry can ever turn into a 202.
            raise ValueError(
                f"VIGIL_MAX_BODY_BYTES ({self.max_body_bytes}) must be at most VIGIL_KAFKA_MESSAGE_MAX_BYTES "
                f"({self.kafka_message_max_bytes}) less {ENVELOPE_RESERVE_BYTES} bytes for the envelope: {bound}"
            )
        return self

    def server_limits(self) -> ServerLimits:
        return ServerLimits(
            max_head_bytes=self.ingest_max_header_bytes,
            max_headers=SERVER.max_headers,
            head_timeout_s=self.ingest_header_timeout_s,
            body_timeout_s=self.ingest_body_timeout_s,
            max_connections=self.ingest_max_connections,
            keep_alive_s=self.ingest_keep_alive_s,
        )
