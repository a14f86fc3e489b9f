"""`vigil console`: the operator console's HTTP service."""

from __future__ import annotations

import click

from vigil.console.main import serve
from vigil.console.settings import ConsoleSettings
from vigil.service import load_or_exit


@click.command("console")
def console_command() -> None:
    """Run the operator console (pages over the ledger; /healthz /readyz /metrics)."""
    serve(load_or_exit(ConsoleSettings))


commands = [console_command]
