"""Events for operators: `vigil dead` (dead events and deliveries), `vigil inbox` (a user's events)."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial

import click

from vigil.admin.shards import Shards, echo_rows, report_down, shard_option, with_shard
from vigil.cliutil import WholeNumber, emit, login_name, table
from vigil.dispatcher.operator import dead_deliveries
from vigil.ledger import console as ledger_console
from vigil.ledger import events as ledger_events
from vigil.ledger.db import connect
from vigil.ledger.events import retry_dead_events
from vigil.service import load_or_exit
from vigil.settings import CommonSettings


def _shards() -> Shards:
    return Shards(load_or_exit(CommonSettings))


def _dead_events(dsn: str, limit: int) -> list[dict]:
    with connect(dsn, autocommit=True) as conn:
        return [asdict(row) for row in ledger_events.dead_list(conn, limit)]


def _death_of_event(row: dict) -> tuple:
    return row["finished_at"], row["id"]


def _death_of_delivery(row: dict) -> tuple:
    return (row["dead_at"],)


def _dead_deliveries(dsn: str, limit: int) -> list[dict]:
    with connect(dsn, autocommit=True) as conn:
        return dead_deliveries(conn, limit)


@click.group()
def dead() -> None:
    """Dead events: attempts exhausted (poison) and kept with their error."""


@dead.command("list")
@click.option("--limit", type=WholeNumber(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def dead_list(limit: int, as_json: bool) -> None:
    """List dead events and dead deliveries, newest first (of every shard: "shard" says whose)."""
    shards = _shards()
    found, down = shards.merged(partial(_dead_events, limit=limit), _death_of_event, limit)
    kept, down_too = shards.merged(partial(_dead_deliveries, limit=limit), _death_of_delivery, limit)
    rows = [with_shard(f.value, f.shard, shards) for f in found]
    deliveries = [with_shard(f.value, f.shard, shards) for f in kept]
    shard = ["shard"] if shards.many else []
    if as_json:
        echo_rows([{"dead": "event", **row} for row in rows] + [{"dead": "delivery", **row} for row in deliveries])
    else:
        click.echo("dead events (vigil dead retry ID...):")
        table(rows, [*shard, "id", "user_id", "source", "source_id", "kind", "attempts", "finished_at", "error"])
        click.echo("\ndead deliveries (vigil outbox --revive DELIVERY_ID):")
        table(deliveries, [*shard, "delivery_id", "user_id", "channel", "attempts", "dead_at", "error"])
    report_down(down or down_too)


@dead.command("retry")
@click.argument("ids", nargs=-1, type=WholeNumber(1), required=True)
@click.option("--actor", default=None, help="Who is retrying (default: your login name).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@shard_option
def dead_retry(ids: tuple[int, ...], actor: str | None, as_json: bool, shard: int | None) -> None:
    """Send dead events back to pending with their attempts reset.

    With several shards each id is retried on the shard where it is dead (--shard: that one)."""
    who = actor or login_name()
    shards = _shards()
    on: dict[int, list[int]] = {} if shards.many else {0: list(ids)}
    for event_id in ids if shards.many else ():
        place = shards.locate(partial(_dead_event, event_id=event_id), f"dead event {event_id}", shard)
        on.setdefault(place.shard if place else (shard or 0), []).append(event_id)
    retried: list[int] = []
    missing: list[int] = []
    for index, some in sorted(on.items()):
        result = shards.on(index, partial(_retry, ids=some, who=who))
        retried += result.retried
        missing += result.missing
    text = f"retried {len(retried)} event(s)" + (f"; not dead (left alone): {missing}" if missing else "")
    emit({"retried": retried, "not_dead": missing}, as_json, text)


def _dead_event(dsn: str, event_id: int) -> bool | None:
    """True where the event is dead, else None (the id may be another shard's)."""
    with connect(dsn, autocommit=True) as conn:
        found = ledger_console.event(conn, event_id)
    return True if found is not None and found.status == "dead" else None


def _retry(dsn: str, ids: list[int], who: str):
    with connect(dsn, autocommit=True) as conn:
        return retry_dead_events(conn, ids, who)


@click.command()
@click.argument("user_id")
@click.option("--limit", type=WholeNumber(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def inbox(user_id: str, limit: int, as_json: bool) -> None:
    """A user's events and their states, newest first (from the user's shard)."""

    def read(dsn: str) -> list[dict]:
        with connect(dsn, autocommit=True) as conn:
            return [asdict(row) for row in ledger_events.inbox(conn, user_id, limit)]

    rows = _shards().on_user(user_id, read)
    if as_json:
        echo_rows(rows)
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


commands = [dead, inbox]
