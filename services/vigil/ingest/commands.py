"""`vigil ingest` and its operator commands."""

from __future__ import annotations

import click


@click.command("ingest")
def ingest_command() -> None:
    """Run the ingest HTTP service."""
    import uvicorn
    from starlette.applications import Starlette

    from vigil.health import Readiness, dependency_checks, health_routes
    from vigil.ingest.settings import IngestSettings
    from vigil.service import load_or_exit

    settings = load_or_exit(IngestSettings)
    app = Starlette(routes=health_routes(Readiness(dependency_checks(settings))))
    uvicorn.run(app, host=settings.ingest_host, port=settings.ingest_port, log_level="warning")


commands = [ingest_command]
