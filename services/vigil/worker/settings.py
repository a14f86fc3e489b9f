"""Settings of `vigil worker`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from vigil.settings import DEFAULT_WORKER_METRICS_PORT, CommonSettings


class WorkerSettings(CommonSettings):
    service_name: ClassVar[str] = "worker"

    worker_port: int = Field(
        DEFAULT_WORKER_METRICS_PORT, ge=1, le=65535, description="Port of the worker's /healthz, /readyz and /metrics."
    )
