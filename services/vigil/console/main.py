"""`vigil console`: the operator console's pages (:mod:`vigil.console.app`) under uvicorn,
within the same bounded server as ingest's port (:mod:`vigil.httpserver`)."""

from __future__ import annotations

import signal
import sys

import uvicorn

from vigil.console.app import create_app
from vigil.console.settings import ConsoleSettings
from vigil.httpserver import server_config


def serve(settings: ConsoleSettings) -> None:
    """Serve until SIGTERM or SIGINT."""
    # As ingest: uvicorn drains on SIGTERM and re-raises it; make that a clean exit (status 0).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # No access log (server_config): page addresses carry user ids; the metrics count requests.
    config = server_config(
        create_app(settings),
        settings.console_host,
        settings.console_port,
        settings.server_limits(),
        log_level="warning",
        log_config=None,  # keep vigil's handler (JSON lines), set up by load_or_exit
    )
    uvicorn.Server(config).run()
