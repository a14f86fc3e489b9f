"""`vigil dispatcher`: the service's start command (channels, the outbox and users' attention
are operated from :mod:`vigil.ops.deliveries`)."""

from __future__ import annotations

import sys

import click

from vigil.dispatcher.main import serve
from vigil.dispatcher.settings import DispatcherSettings
from vigil.service import load_or_exit, require_schema, require_secret_keys


@click.command("dispatcher")
def dispatcher_command() -> None:
    """Run the dispatcher: relay the outbox to each user's channel, paced per user."""
    settings = load_or_exit(DispatcherSettings)
    require_schema(settings)
    require_secret_keys(settings)
    sys.exit(serve(settings))


commands = [dispatcher_command]
