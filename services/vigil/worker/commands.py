"""`vigil worker`: the service's start command (`vigil dead` and `vigil inbox` are in
:mod:`vigil.ops.events`)."""

from __future__ import annotations

import sys

import click

from vigil.service import load_or_exit, require_schema
from vigil.worker.settings import WorkerSettings


@click.command("worker")
def worker_command() -> None:
    """Run a worker: consume events, record them in the ledger, run the agent."""
    # The worker's own modules (the agent, the anthropic SDK: two seconds of imports) load
    # here, not for every `vigil` command that only reads the ledger.
    from vigil.worker.main import serve

    settings = load_or_exit(WorkerSettings)
    require_schema(settings)
    sys.exit(serve(settings))


commands = [worker_command]
