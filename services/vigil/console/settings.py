"""Settings of `vigil console`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from vigil.settings import CommonSettings

DEFAULT_CONSOLE_PORT = 9105
# The console shows payloads and lets its user retry dead work: by default it answers on
# this machine only; exposing it is a decision (VIGIL_CONSOLE_HOST=0.0.0.0 behind TLS).
DEFAULT_CONSOLE_HOST = "127.0.0.1"
# As ingest: a revoked token stops opening pages within this bound, without a ledger round
# trip on every page.
DEFAULT_AUTH_CACHE_S = 5.0


class ConsoleSettings(CommonSettings):
    service_name: ClassVar[str] = "console"

    console_port: int = Field(
        DEFAULT_CONSOLE_PORT,
        ge=1,
        le=65535,
        description="HTTP port of the operator console (pages, /healthz, /readyz, /metrics).",
    )
    console_host: str = Field(
        DEFAULT_CONSOLE_HOST,
        description="Address the console listens on (default: this machine only; put TLS in front before widening it).",
    )
    console_auth_cache_s: float = Field(
        DEFAULT_AUTH_CACHE_S,
        ge=0,
        le=300,
        description="Seconds the console caches an API token's lookup: a revocation takes effect within this bound.",
    )
