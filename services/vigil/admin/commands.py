"""Ledger and topic administration: ``vigil migrate``, ``vigil topics``."""

from __future__ import annotations

import json
import sys

import click

from vigil.bus.kafka import TopicError
from vigil.bus.topics import ensure
from vigil.cliutil import emit
from vigil.ledger.migrate import migrate as run
from vigil.ledger.migrate import pending
from vigil.service import load_or_exit
from vigil.settings import CommonSettings


@click.command()
@click.option(
    "--check", is_flag=True, help="Apply nothing; exit 1 while migrations are pending (an init container's gate)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def migrate(check: bool, as_json: bool) -> None:
    """Apply the ledger's migrations (idempotent; safe from several replicas at once)."""
    settings = load_or_exit(CommonSettings)
    if check:
        behind = pending(settings.dsn)
        text = f"ledger is behind: {len(behind)} pending ({', '.join(behind)})" if behind else "ledger is up to date"
        emit({"up_to_date": not behind, "pending": behind}, as_json, text)
        if behind:
            sys.exit(1)
        return
    applied = run(settings.dsn)
    emit({"applied": applied}, as_json, "applied: " + ", ".join(applied) if applied else "ledger is up to date")


@click.command()
@click.option("--timeout", default=10.0, show_default=True, help="Seconds to wait for the broker.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def topics(timeout: float, as_json: bool) -> None:
    """Create the missing topics, then say how each one differs from the settings.

    Existing topics are never changed: the differences are printed for an operator to act on
    (docs/deploy.md). Exit 0 even when they differ: a cluster may be tuned on purpose.
    """
    settings = load_or_exit(CommonSettings)
    try:
        states = ensure(settings, timeout)
    except TopicError as exc:
        click.echo(f"vigil: {exc}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"topics": [state.as_dict() for state in states]}))
        return
    for state in states:
        config = " ".join(f"{key}={value}" for key, value in sorted(state.config.items()))
        verb = "created" if state.created else "exists "
        click.echo(
            f"{verb} {state.name}: {state.partitions} partitions, replication {state.replication}, {config}".rstrip()
        )
        for difference in state.differences:
            click.echo(f"  differs: {difference}")


commands = [migrate, topics]
