"""Settings of `vigil dispatcher`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from vigil.settings import DEFAULT_DISPATCHER_METRICS_PORT, CommonSettings


class DispatcherSettings(CommonSettings):
    service_name: ClassVar[str] = "dispatcher"

    dispatcher_port: int = Field(
        DEFAULT_DISPATCHER_METRICS_PORT, ge=1, le=65535, description="Port of the dispatcher's /healthz, /readyz and /metrics."
    )
