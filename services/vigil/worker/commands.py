"""`vigil worker` and the operator commands for events: `vigil dead`, `vigil inbox`."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click

from vigil.admin.connection import cli_connection
from vigil.cliutil import emit, login_name, table
from vigil.dispatcher.operator import dead_deliveries
from vigil.ledger import events as ledger_events
from vigil.ledger.events import retry_dead_events
from vigil.service import load_or_exit, require_schema
from vigil.worker.main import serve
from vigil.worker.settings import WorkerSettings


@click.command("worker")
def worker_command() -> None:
    """Run a worker: consume events, record them in the ledger, run the agent."""
    settings = load_or_exit(WorkerSettings)
    require_schema(settings, routes_shards=True)  # every user's ledger work on their shard (worker/shards.py)
    sys.exit(serve(settings))


def _ledger():
    return cli_connection()


@click.group()
def dead() -> None:
    """Dead events: attempts exhausted (poison) and kept with their error."""


@dead.command("list")
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def dead_list(limit: int, as_json: bool) -> None:
    """List dead events and dead deliveries, newest first."""
    with _ledger() as conn:
        rows = [asdict(row) for row in ledger_events.dead_list(conn, limit)]
    with _ledger() as conn:
        deliveries = dead_deliveries(conn, limit)
    if as_json:
        for row in rows:
            click.echo(json.dumps({"dead": "event", **row}, default=str))
        for row in deliveries:
            click.echo(json.dumps({"dead": "delivery", **row}, default=str))
        return
    click.echo("dead events (vigil dead retry ID...):")
    table(rows, ["id", "user_id", "source", "source_id", "kind", "attempts", "finished_at", "error"])
    click.echo("\ndead deliveries (vigil outbox --revive DELIVERY_ID):")
    table(deliveries, ["delivery_id", "user_id", "channel", "attempts", "dead_at", "error"])


@dead.command("retry")
@click.argument("ids", nargs=-1, type=int, required=True)
@click.option("--actor", default=None, help="Who is retrying (default: your login name).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def dead_retry(ids: tuple[int, ...], actor: str | None, as_json: bool) -> None:
    """Send dead events back to pending with their attempts reset."""
    who = actor or login_name()
    with _ledger() as conn:
        result = retry_dead_events(conn, list(ids), who)
    missing = result.missing
    text = f"retried {len(result.retried)} event(s)" + (f"; not dead (left alone): {missing}" if missing else "")
    emit({"retried": list(result.retried), "not_dead": missing}, as_json, text)


@click.command()
@click.argument("user_id")
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def inbox(user_id: str, limit: int, as_json: bool) -> None:
    """A user's events and their states, newest first."""
    with _ledger() as conn:
        rows = [asdict(row) for row in ledger_events.inbox(conn, user_id, limit)]
    if as_json:
        for row in rows:
            click.echo(json.dumps(row, default=str))
    else:
        table(
            rows,
            [
                "id",
                "source",
                "source_id",
                "kind",
                "status",
                "attempts",
                "lost_claims",
                "claim_epoch",
                "run_id",
                "error",
            ],
        )


commands = [worker_command, dead, inbox]
