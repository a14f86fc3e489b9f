"""``vigil config``: every VIGIL_ setting of every service, one table (docs/settings.md's too).

It reads every service's settings class, so it sits above the services rather than in any
one of them (``python -m vigil.readme`` writes the same table into docs/settings.md).
"""

from __future__ import annotations

import json

import click

from vigil.agent.settings import AgentSettings
from vigil.console.settings import ConsoleSettings
from vigil.dispatcher.settings import DispatcherSettings
from vigil.ingest.settings import IngestSettings
from vigil.scheduler.settings import SchedulerSettings
from vigil.settings import CommonSettings, settings_rows, settings_table
from vigil.worker.settings import WorkerSettings

# Every settings class, in the order of the configuration table.
SETTINGS_CLASSES: list[type[CommonSettings]] = [
    CommonSettings,
    IngestSettings,
    WorkerSettings,
    SchedulerSettings,
    DispatcherSettings,
    AgentSettings,
    ConsoleSettings,
]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of {variable, services, default, meaning}.")
def config(as_json: bool) -> None:
    """Print every VIGIL_ setting as a Markdown table (docs/settings.md)."""
    if as_json:
        click.echo(json.dumps(settings_rows(SETTINGS_CLASSES)))
        return
    click.echo(settings_table(SETTINGS_CLASSES))


commands = [config]
