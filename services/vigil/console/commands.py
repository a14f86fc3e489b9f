"""`vigil console`: the operator console's HTTP service."""

from __future__ import annotations

import signal
import sys

import click


@click.command("console")
def console_command() -> None:
    """Run the operator console (pages over the ledger; /healthz /readyz /metrics)."""
    import uvicorn

    from vigil.console.app import create_app
    from vigil.console.settings import ConsoleSettings
    from vigil.service import load_or_exit

    settings = load_or_exit(ConsoleSettings)
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


commands = [console_command]
