"""`vigil scheduler`: the service's start command (`vigil timers` is in :mod:`vigil.ops.timers`)."""

from __future__ import annotations

import sys

import click

from vigil.scheduler.main import serve
from vigil.scheduler.settings import SchedulerSettings
from vigil.service import load_or_exit, require_schema


@click.command("scheduler")
def scheduler_command() -> None:
    """Run the scheduler service: due timers become events on the events topic."""
    settings = load_or_exit(SchedulerSettings)
    require_schema(settings)
    sys.exit(serve(settings))


commands = [scheduler_command]
