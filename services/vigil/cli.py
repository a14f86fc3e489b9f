"""The ``vigil`` command: every service and every operator tool.

Each area contributes its commands from its own module (a ``commands`` list of click
commands), imported here by name: a module that is missing or broken is an import error at
start-up, never a command that silently is not there.
"""

from __future__ import annotations

import sys

import click

from vigil import config_command
from vigil.admin import commands as admin_commands
from vigil.agent import commands as agent_commands
from vigil.agent import profile_commands
from vigil.console import commands as console_commands
from vigil.dispatcher import commands as dispatcher_commands
from vigil.ingest import commands as ingest_commands
from vigil.scheduler import commands as scheduler_commands
from vigil.service import VigilGroup
from vigil.worker import commands as worker_commands
from vigil.worker import memory_commands, run_commands, task_commands

COMMAND_MODULES = (
    admin_commands,
    config_command,
    worker_commands,
    task_commands,
    memory_commands,
    run_commands,
    ingest_commands,
    scheduler_commands,
    dispatcher_commands,
    agent_commands,
    profile_commands,
    console_commands,
)


@click.group(cls=VigilGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="vigil")
def main() -> None:
    """vigil: an always-on agent runtime on Kafka and PostgreSQL.

    Services: ingest, worker, scheduler, dispatcher. Settings come from VIGIL_* environment
    variables (`vigil config` lists them); `. .run/env` after `make up` points a shell at the
    local stack.
    """


for _module in COMMAND_MODULES:
    for _command in _module.commands:
        main.add_command(_command)

if __name__ == "__main__":
    sys.exit(main())
