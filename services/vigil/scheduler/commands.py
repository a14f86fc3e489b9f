"""`vigil scheduler` and its operator commands."""

from __future__ import annotations

import click


@click.command("scheduler")
def scheduler_command() -> None:
    """Run the scheduler service."""
    from vigil.scheduler.settings import SchedulerSettings
    from vigil.service import load_or_exit
    from vigil.stub import run_idle

    settings = load_or_exit(SchedulerSettings)
    run_idle(settings, settings.scheduler_port, "scheduler")


commands = [scheduler_command]
