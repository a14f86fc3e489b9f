"""`vigil worker` and its operator commands."""

from __future__ import annotations

import click


@click.command("worker")
def worker_command() -> None:
    """Run a worker: consume events, record them in the ledger, run the agent."""
    from vigil.service import load_or_exit
    from vigil.stub import run_idle
    from vigil.worker.settings import WorkerSettings

    settings = load_or_exit(WorkerSettings)
    run_idle(settings, settings.worker_port, "worker")


commands = [worker_command]
