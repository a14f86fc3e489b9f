"""The ``vigil`` command: every service and every operator tool.

Each area contributes its commands from its own module (``vigil.<area>.commands``, a
``commands`` list of click commands), so the services stay independent of each other.
"""

from __future__ import annotations

import importlib
import json
import sys

import click

from vigil.service import VigilGroup

COMMAND_MODULES = [
    "vigil.ledger.commands",
    "vigil.worker.commands",
    "vigil.worker.task_commands",
    "vigil.ingest.commands",
    "vigil.scheduler.commands",
    "vigil.dispatcher.commands",
    "vigil.agent.commands",
    "vigil.console.commands",
]


@click.group(cls=VigilGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="vigil")
def main() -> None:
    """vigil: an always-on agent runtime on Kafka and PostgreSQL.

    Services: ingest, worker, scheduler, dispatcher. Settings come from VIGIL_* environment
    variables (`vigil config` lists them); `. .run/env` after `make up` points a shell at the
    local stack.
    """


def emit(obj: dict, as_json: bool, text: str) -> None:
    """Print a created object: one JSON object with --json, else a human line."""
    click.echo(json.dumps(obj, default=str) if as_json else text)


def _register() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # that area has no commands yet
            raise
        for command in module.commands:
            main.add_command(command)


_register()

if __name__ == "__main__":
    sys.exit(main())
