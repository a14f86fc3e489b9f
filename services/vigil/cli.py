"""The ``vigil`` command: every service and every operator tool.

Each area contributes its commands from its own module (a ``commands`` list of click
commands). ``COMMANDS`` names the module of each, and a command's module is imported only
when that command runs (``vigil --help`` imports them all, for their summaries):
tests/test_cli_lazy.py checks the table against every module's list, so a command is never
silently missing.
"""

from __future__ import annotations

import sys

import click

from vigil.service import VigilGroup

AREAS = {
    "vigil.admin.commands": ("migrate", "shards", "topics", "secrets"),
    "vigil.config_command": ("config",),
    "vigil.worker.commands": ("worker", "dead", "inbox"),
    "vigil.worker.task_commands": ("tasks",),
    "vigil.worker.memory_commands": ("memory",),
    "vigil.worker.run_commands": ("runs",),
    "vigil.ingest.commands": ("ingest", "tokens", "hooks"),
    "vigil.scheduler.commands": ("scheduler", "timers"),
    "vigil.dispatcher.commands": ("dispatcher", "channels", "outbox", "users"),
    "vigil.agent.commands": ("approvals", "policies", "tools"),
    "vigil.agent.profile_commands": ("profiles",),
    "vigil.console.commands": ("console",),
}
COMMANDS = {name: module for module, names in AREAS.items() for name in names}


@click.group(
    cls=VigilGroup,
    lazy=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="vigil")
def main() -> None:
    """vigil: an always-on agent runtime on Kafka and PostgreSQL.

    Services: ingest, worker, scheduler, dispatcher. Settings come from VIGIL_* environment
    variables (`vigil config` lists them); `. .run/env` after `make up` points a shell at the
    local stack.
    """


if __name__ == "__main__":
    sys.exit(main())
