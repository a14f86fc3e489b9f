"""`vigil console`: the operator console's pages (:mod:`vigil.console.app`) under uvicorn."""

from __future__ import annotations

import signal
import sys

import uvicorn

from vigil.console.app import create_app
from vigil.console.settings import ConsoleSettings


def serve(settings: ConsoleSettings) -> None:
    """Serve until SIGTERM or SIGINT."""
    # As ingest: uvicorn drains on SIGTERM and re-raises it; make that a clean exit (status 0).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(
        create_app(settings),
        host=settings.console_host,
        port=settings.console_port,
        log_level="warning",
        access_log=False,  # page addresses carry user ids; the metrics count requests
        server_header=False,
    )
