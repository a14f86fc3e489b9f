"""Health and metrics endpoints for the services that have no HTTP API of their own.

``/healthz`` answers 200 while the process runs (a liveness probe: restart me if not);
``/readyz`` answers 200 only while the service's dependencies answer (Kafka, PostgreSQL), so
a load balancer or an orchestrator can hold traffic back (ingest excepted: see
:class:`Readiness`); ``/metrics`` is Prometheus' text
format. Served by uvicorn on a daemon thread so the service's own loop stays in control.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import anyio
import psycopg
import uvicorn
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, disable_created_metrics, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vigil.bus.kafka import quiet_admin
from vigil.httpserver import HEALTH_LIMITS, HostCheck, on_http_exception, on_unexpected, server_config
from vigil.ledger import db
from vigil.service import StartupError
from vigil.settings import CommonSettings

log = logging.getLogger(__name__)

# No `_created` series: prometheus_client adds one per counter and histogram label set, which
# doubles the series count and no dashboard or rule of vigil reads. Every service serves
# /metrics through this module (ingest mounts health_routes), so this is the one place.
disable_created_metrics()

# Checks run on a background thread every READY_REFRESH_S, never in the probe's request: a
# probe answers from the last results at once, so it always fits the probe's 1 s timeout,
# and any number of probes costs one check per interval. Each check is bounded by
# CHECK_TIMEOUT_S; results older than READY_STALE_S (a check thread stuck past its bounds)
# count as failed.
READY_REFRESH_S = 2.0
CHECK_TIMEOUT_S = 1.0
READY_STALE_S = 10.0
FIRST_PASS_WAIT_S = 0.5


class DatabaseCheck:
    """``SELECT 1`` on one kept connection; a broken one is replaced at the next check."""

    def __init__(self, dsn: str, timeout_s: float = CHECK_TIMEOUT_S):
        self.dsn = dsn
        self.timeout_s = timeout_s
        self._conn: psycopg.Connection | None = None

    def __call__(self) -> bool:
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = db.connect(
                    self.dsn,
                    autocommit=True,
                    connect_timeout=max(1, round(self.timeout_s)),
                    statement_timeout_ms=int(self.timeout_s * 1000),
                )
            db.is_alive(self._conn)
            return True
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return False


class KafkaCheck:
    """Metadata of the events topic through one kept admin client."""

    def __init__(self, settings: CommonSettings, timeout_s: float = CHECK_TIMEOUT_S):
        self.settings = settings
        self.timeout_s = timeout_s
        self._admin: AdminClient | None = None

    def __call__(self) -> bool:
        if self._admin is None:
            self._admin = quiet_admin(self.settings)
        try:
            metadata = self._admin.list_topics(self.settings.events_topic, timeout=self.timeout_s)
        except KafkaException:
            return False
        topic = metadata.topics.get(self.settings.events_topic)
        return topic is not None and topic.error is None and bool(metadata.brokers)


def dependency_checks(settings: CommonSettings) -> dict[str, Callable[[], bool]]:
    return {"kafka": KafkaCheck(settings), "database": DatabaseCheck(settings.dsn)}


class Readiness:
    """Dependency checks refreshed in the background, plus flags a service sets itself.

    ``gating``: the checks that decide the HTTP status (default: all). ingest passes none:
    with the broker or the ledger down it still answers every request itself (503 with
    Retry-After), which is better for its clients than the Service dropping it and them
    getting connection errors; its /readyz still reports each check in the body.
    """

    def __init__(self, checks: dict[str, Callable[[], bool]], gating: set[str] | None = None):
        self.checks = checks
        self.gating = set(checks) if gating is None else gating
        self.flags: dict[str, bool] = {}
        # Named in the body, never gating: e.g. the worker's MCP servers that are down.
        self.notes: dict[str, Callable[[], object]] = {}
        self._at = 0.0
        self._last: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def set(self, name: str, ok: bool) -> None:
        self.flags[name] = ok

    def refresh(self) -> None:
        results = {name: check() for name, check in self.checks.items()}
        with self._lock:
            self._last, self._at = results, time.monotonic()

    def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.refresh()
            except Exception:  # a check must never kill the refresher: it reports not-ready
                log.exception("readiness check failed")
            time.sleep(max(0.1, READY_REFRESH_S - (time.monotonic() - started)))

    def start(self) -> Readiness:
        """Start the background checks (idempotent); services call it at start-up."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="readiness", daemon=True)
                self._thread.start()
        return self

    def status(self) -> dict[str, bool]:
        """Last results, at once; until the first pass ends, every check counts as failed.

        The first call starts the checks if the service did not, and waits for their first
        pass at most FIRST_PASS_WAIT_S, which stays under the probe's timeout.
        """
        if self._thread is None:
            self.start()
            deadline = time.monotonic() + FIRST_PASS_WAIT_S
            while self._at == 0.0 and time.monotonic() < deadline:
                time.sleep(0.02)
        with self._lock:
            fresh = time.monotonic() - self._at < READY_STALE_S
            checks = {name: bool(ok and fresh) for name, ok in self._last.items()} if self._at else {}
        return {**{name: False for name in self.checks}, **checks, **self.flags}

    def ready(self, status: dict[str, bool]) -> bool:
        return all(ok for name, ok in status.items() if name in self.gating or name in self.flags)


def health_routes(readiness: Readiness) -> list[Route]:
    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> Response:
        status = await anyio.to_thread.run_sync(readiness.status)
        ok = readiness.ready(status)
        body: dict[str, object] = {"ready": ok, "checks": status}
        body.update({name: note() for name, note in readiness.notes.items()})
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return [Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)]


class HealthServer:
    """uvicorn on a daemon thread serving the health routes."""

    def __init__(self, port: int, readiness: Readiness, host: str = "0.0.0.0"):
        self.readiness = readiness
        app = Starlette(
            routes=health_routes(readiness),
            middleware=[Middleware(HostCheck)],
            exception_handlers={HTTPException: on_http_exception, Exception: on_unexpected},
        )
        config = server_config(app, host, port, HEALTH_LIMITS, log_level="warning", log_config=None, lifespan="off")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # the service owns the signals
        self.port = port
        self.host = host
        self.thread: threading.Thread | None = None

    def start(self) -> HealthServer:
        self.readiness.start()
        # Bind here, not in uvicorn's thread: a port taken is then one StartupError line
        # (exit 2) instead of uvicorn's own error log followed by ours.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise StartupError(
                f"port {self.port} is not free for /healthz and /metrics ({exc.strerror}; set the service's "
                "VIGIL_*_PORT)"
            ) from None
        sock.set_inheritable(True)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="health", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise StartupError(
                    f"port {self.port} is not free for /healthz and /metrics (set the service's VIGIL_*_PORT)"
                )
            time.sleep(0.02)
        log.info("health and metrics on :%d (/healthz /readyz /metrics)", self.port)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(5)
