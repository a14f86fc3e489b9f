"""Settings of `vigil scheduler`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from vigil.settings import DEFAULT_SCHEDULER_METRICS_PORT, CommonSettings


class SchedulerSettings(CommonSettings):
    service_name: ClassVar[str] = "scheduler"

    scheduler_port: int = Field(
        DEFAULT_SCHEDULER_METRICS_PORT, ge=1, le=65535, description="Port of the scheduler's /healthz, /readyz and /metrics."
    )
