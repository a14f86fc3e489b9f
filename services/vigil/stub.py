"""A service with no work of its own yet: connects, serves health, waits for SIGTERM."""

from __future__ import annotations

import logging

from vigil.health import HealthServer, Readiness, dependency_checks
from vigil.service import stop_event
from vigil.settings import CommonSettings


def run_idle(settings: CommonSettings, port: int, name: str) -> None:
    stopping = stop_event()
    readiness = Readiness(dependency_checks(settings))
    server = HealthServer(port, readiness).start()
    logging.getLogger(f"vigil.{name}").info("%s up", name)
    stopping.wait()
    server.stop()
