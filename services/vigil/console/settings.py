"""Settings of `vigil console`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from vigil.httpserver import ServerLimits
from vigil.settings import CommonSettings

DEFAULT_CONSOLE_PORT = 9105
# The console shows payloads and lets its user retry dead work: by default it answers on
# this machine only; exposing it is a decision (VIGIL_CONSOLE_HOST=0.0.0.0 behind TLS).
DEFAULT_CONSOLE_HOST = "127.0.0.1"
# As ingest: a revoked token stops opening pages within this bound, without a ledger round
# trip on every page.
DEFAULT_AUTH_CACHE_S = 5.0
# A working day: an operator logs in once a shift; a cookie left on a shared machine dies tonight.
DEFAULT_SESSION_S = 8 * 3600
SERVER = ServerLimits()
# A handful of operators, each browser opening about six connections.
CONSOLE_MAX_CONNECTIONS = 200


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
    console_session_s: int = Field(
        DEFAULT_SESSION_S,
        ge=60,
        le=30 * 86_400,
        description="Seconds a console login lasts (the cookie's Max-Age and the session's end in the ledger; "
        "never past the token's own expiry).",
    )
    # The console's port is bounded like ingest's (vigil.httpserver): its heads carry a cookie,
    # not much more, and an operator's browser sends them at once.
    console_max_header_bytes: int = Field(
        SERVER.max_head_bytes,
        ge=1024,
        le=1024 * 1024,
        description="Largest request line plus headers the console reads; larger is refused with 431.",
    )
    console_header_timeout_s: float = Field(
        SERVER.head_timeout_s, gt=0, le=300, description="Seconds a console client has to send a request's head (408)."
    )
    console_body_timeout_s: float = Field(
        SERVER.body_timeout_s, gt=0, le=3600, description="Seconds a console client has to send a form's body (408)."
    )
    console_max_connections: int = Field(
        CONSOLE_MAX_CONNECTIONS,
        ge=1,
        le=100_000,
        description="Most open HTTP connections the console holds; one more is answered 503 and closed.",
    )

    def server_limits(self) -> ServerLimits:
        return ServerLimits(
            max_head_bytes=self.console_max_header_bytes,
            head_timeout_s=self.console_header_timeout_s,
            body_timeout_s=self.console_body_timeout_s,
            max_connections=self.console_max_connections,
        )
