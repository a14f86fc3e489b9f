"""`vigil ingest`: the service's start command (the operator commands for tokens and hooks
are in :mod:`vigil.ops.access`)."""

from __future__ import annotations

import click

from vigil.ingest.main import serve
from vigil.ingest.settings import IngestSettings
from vigil.service import load_or_exit, require_schema, require_secret_keys


@click.command("ingest")
def ingest_command() -> None:
    """Run the ingest HTTP service (API, webhooks, approvals, /healthz /readyz /metrics)."""
    settings = load_or_exit(IngestSettings)
    require_schema(settings)
    require_secret_keys(settings)
    serve(settings)


commands = [ingest_command]
