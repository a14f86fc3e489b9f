"""Health and metrics endpoints for the services that have no HTTP API of their own.

``/healthz`` answers 200 while the process runs (a liveness probe: restart me if not);
``/readyz`` answers 200 only while the service's dependencies answer (Kafka, PostgreSQL), so
a load balancer or an orchestrator can hold traffic back; ``/metrics`` is Prometheus' text
format. Served by uvicorn on a daemon thread so the service's own loop stays in control.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psycopg
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vigil.bus.kafka import broker_reachable
from vigil.httpserver import HEALTH_LIMITS, server_config
from vigil.settings import CommonSettings

log = logging.getLogger(__name__)

# Readiness probes arrive every few seconds; one real check per interval is plenty and keeps
# a probe storm from turning into a connection storm on the database.
READY_CACHE_S = 2.0


def dependency_checks(settings: CommonSettings) -> dict[str, Callable[[], bool]]:
    def database() -> bool:
        try:
            with psycopg.connect(settings.dsn, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    return {"kafka": lambda: broker_reachable(settings), "database": database}


class Readiness:
    """Cached results of the dependency checks, plus flags a service sets itself."""

    def __init__(self, checks: dict[str, Callable[[], bool]]):
        self.checks = checks
        self.flags: dict[str, bool] = {}
        self._at = 0.0
        self._last: dict[str, bool] = {}
        self._lock = threading.Lock()

    def set(self, name: str, ok: bool) -> None:
        self.flags[name] = ok

    def status(self) -> dict[str, bool]:
        with self._lock:
            if time.monotonic() - self._at > READY_CACHE_S:
                self._last = {name: check() for name, check in self.checks.items()}
                self._at = time.monotonic()
            return {**self._last, **self.flags}


def health_routes(readiness: Readiness) -> list[Route]:
    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        import anyio

        status = await anyio.to_thread.run_sync(readiness.status)
        ok = all(status.values())
        return JSONResponse({"ready": ok, "checks": status}, status_code=200 if ok else 503)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return [Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)]


class HealthServer:
    """uvicorn on a daemon thread serving the health routes."""

    def __init__(self, port: int, readiness: Readiness, host: str = "0.0.0.0"):
        app = Starlette(routes=health_routes(readiness))
        config = server_config(app, host, port, HEALTH_LIMITS, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the service owns the signals
        self.thread = threading.Thread(target=self.server.run, name="health", daemon=True)
        self.port = port

    def start(self) -> HealthServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            if not self.thread.is_alive():
                from vigil.service import StartupError

                raise StartupError(
                    f"port {self.port} is not free for /healthz and /metrics (set the service's VIGIL_*_PORT)"
                )
            time.sleep(0.02)
        log.info("health and metrics on :%d (/healthz /readyz /metrics)", self.port)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
