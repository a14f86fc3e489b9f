"""Ingest served inside the test process, on a real socket.

The same application and the same uvicorn server as `vigil ingest`, on a thread with its
own event loop, so a test can pass hooks the command line cannot (a slow step before an
approval is stored) and still talk HTTP to it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from vigil.httpserver import server_config
from vigil.ingest.app import create_app
from vigil.ingest.settings import IngestSettings

START_TIMEOUT_S = 20.0


class EmbeddedIngest:
    def __init__(self, settings: IngestSettings, **app_options: Any):
        self.settings = settings
        self.app = create_app(settings, **app_options)
        config = server_config(
            self.app, "127.0.0.1", settings.ingest_port, settings.server_limits(), log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # the host process owns signals
        self.thread = threading.Thread(target=self.server.run, name="ingest", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ingest_port}"

    def start(self) -> EmbeddedIngest:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"embedded ingest did not start on port {self.settings.ingest_port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self) -> EmbeddedIngest:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()
