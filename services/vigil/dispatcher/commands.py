"""`vigil dispatcher` and its operator commands."""

from __future__ import annotations

import click


@click.command("dispatcher")
def dispatcher_command() -> None:
    """Run the dispatcher service."""
    from vigil.dispatcher.settings import DispatcherSettings
    from vigil.service import load_or_exit
    from vigil.stub import run_idle

    settings = load_or_exit(DispatcherSettings)
    run_idle(settings, settings.dispatcher_port, "dispatcher")


commands = [dispatcher_command]
