"""`vigil ingest`: the ASGI application (:mod:`vigil.ingest.app`) under uvicorn.

SIGTERM: uvicorn stops accepting, lets in-flight requests finish (their produce waits
included, bounded by ``VIGIL_PRODUCE_TIMEOUT_S``), then the app's lifespan flushes the
producer and closes the pools; the process exits 0.
"""

from __future__ import annotations

import signal
import sys

import uvicorn

from vigil import tracing
from vigil.httpserver import server_config
from vigil.ingest.app import create_app
from vigil.ingest.settings import IngestSettings


def serve(settings: IngestSettings) -> None:
    """Serve until SIGTERM or SIGINT."""
    tracing.setup("ingest")  # only when OTEL_EXPORTER_OTLP_ENDPOINT is set
    # uvicorn drains requests on SIGTERM, then re-raises the signal to the handler it found:
    # make that handler a clean exit, so a graceful stop ends with status 0, not -15.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # No access log: it would carry paths and client addresses at request rate, and the
    # metrics answer the questions an access log would.
    config = server_config(
        create_app(settings),
        settings.ingest_host,
        settings.ingest_port,
        settings.server_limits(),
        log_level="warning",
        log_config=None,  # keep vigil's handler (JSON lines), set up by load_or_exit
        timeout_graceful_shutdown=int(settings.produce_timeout_s) + 5,
    )
    uvicorn.Server(config).run()
