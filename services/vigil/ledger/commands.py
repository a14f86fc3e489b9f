"""Ledger and topic administration: ``vigil migrate``, ``vigil topics``, ``vigil config``."""

from __future__ import annotations

import importlib

import click

from vigil.service import load_or_exit
from vigil.settings import CommonSettings, settings_table

# Service settings classes, for the configuration table.
SETTINGS_CLASSES = [
    "vigil.ingest.settings:IngestSettings",
    "vigil.worker.settings:WorkerSettings",
    "vigil.scheduler.settings:SchedulerSettings",
    "vigil.dispatcher.settings:DispatcherSettings",
    "vigil.agent.settings:AgentSettings",
    "vigil.console.settings:ConsoleSettings",
]


def all_settings_classes() -> list[type[CommonSettings]]:
    classes: list[type[CommonSettings]] = [CommonSettings]
    for spec in SETTINGS_CLASSES:
        module, _, name = spec.partition(":")
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except ModuleNotFoundError:
            continue
    return classes


@click.command()
def migrate() -> None:
    """Apply the ledger's migrations (idempotent; safe from several replicas at once)."""
    from vigil.ledger.migrate import migrate as run

    settings = load_or_exit(CommonSettings)
    applied = run(settings.dsn)
    click.echo("applied: " + ", ".join(applied) if applied else "ledger is up to date")


@click.command()
def topics() -> None:
    """Create the events, dead-letter and deliveries topics if they are missing."""
    from vigil.bus.kafka import ensure_topics

    settings = load_or_exit(CommonSettings)
    ensure_topics(
        settings,
        {
            settings.events_topic: settings.partitions,
            settings.dlq_topic: settings.partitions,
            settings.deliveries_topic: settings.partitions,
        },
    )
    click.echo(
        f"topics ready: {settings.events_topic} ({settings.partitions} partitions),"
        f" {settings.dlq_topic}, {settings.deliveries_topic}"
    )


@click.command()
def config() -> None:
    """Print every VIGIL_ setting as a Markdown table (the README's configuration section)."""
    click.echo(settings_table(all_settings_classes()))


commands = [migrate, topics, config]
