"""Settings of `vigil ingest`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, SecretStr

from vigil.settings import DEFAULT_INGEST_PORT, CommonSettings

# The bound: large enough for any provider's webhook (GitHub caps deliveries at
# 25 MB, but real push payloads are a few hundred KiB), small enough that a flood of big
# bodies cannot exhaust memory at high concurrency.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
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
    max_body_bytes: int = Field(
        DEFAULT_MAX_BODY_BYTES,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest request body ingest accepts; larger is refused with 413 before it is read whole.",
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
