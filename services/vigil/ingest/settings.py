"""Settings of `vigil ingest`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from vigil.settings import DEFAULT_INGEST_PORT, CommonSettings


class IngestSettings(CommonSettings):
    service_name: ClassVar[str] = "ingest"

    ingest_port: int = Field(
        DEFAULT_INGEST_PORT, ge=1, le=65535, description="HTTP port of ingest (API, /healthz, /readyz, /metrics)."
    )
    ingest_host: str = Field("0.0.0.0", description="Address ingest listens on.")
