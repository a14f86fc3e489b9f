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
    # Each service's start command, in its own package.
    "vigil.ingest.commands": ("ingest",),
    "vigil.worker.commands": ("worker",),
    "vigil.scheduler.commands": ("scheduler",),
    "vigil.dispatcher.commands": ("dispatcher",),
    "vigil.console.commands": ("console",),
    # Every operator command, in vigil.ops.
    "vigil.ops.admin": ("migrate", "topics", "secrets"),
    "vigil.ops.shards": ("shards",),
    "vigil.ops.config": ("config",),
    "vigil.ops.events": ("dead", "inbox"),
    "vigil.ops.tasks": ("tasks",),
    "vigil.ops.memory": ("memory",),
    "vigil.ops.runs": ("runs",),
    "vigil.ops.access": ("tokens", "hooks"),
    "vigil.ops.timers": ("timers",),
    "vigil.ops.deliveries": ("channels", "outbox", "users"),
    "vigil.ops.agent": ("approvals", "policies", "tools"),
    "vigil.ops.profiles": ("profiles",),
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
