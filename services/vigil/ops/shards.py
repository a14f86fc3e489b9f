"""`vigil shards`: every ledger shard, its partitions and whether it answers; `vigil shards move`
moves one partition's rows to another shard (docs/operations.md, "Several shards")."""

from __future__ import annotations

import sys

import click
import psycopg

from vigil.admin.shards import CONNECT_TIMEOUT_S
from vigil.cliutil import EXIT_CONFLICT, INT_MAX, WholeNumber, emit, table
from vigil.ledger import shardmove
from vigil.ledger import shards as shard_rows
from vigil.ledger.db import connect
from vigil.ledger.migrate import pending
from vigil.ledger.shardmap import ShardMap, ShardMapError, shown_dsn
from vigil.service import EXIT_DEPENDENCY, EXIT_STARTUP, StartupError, first_line, load_or_exit
from vigil.settings import CommonSettings


def _catalog_map(settings: CommonSettings) -> tuple[ShardMap, str]:
    """The map, and where it came from: the catalog's rows, or the rule alone (no rows yet, or
    a catalog that does not answer: then the listing says so)."""
    dsns = settings.shard_dsns
    try:
        with connect(dsns[0], autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            rows = shard_rows.assigned(conn)
        source = "catalog" if rows else "rule"
    except psycopg.OperationalError:
        rows, source = None, "rule (the catalog does not answer)"
    try:
        return ShardMap(dsns, rows or {}), source
    except ShardMapError as exc:
        raise StartupError(str(exc)) from None


def _shard_row(index: int, dsn: str, partitions: list[int]) -> dict:
    row: dict = {
        "shard": index,
        "dsn": shown_dsn(dsn),
        "partitions": partitions,
        "reachable": False,
        "error": None,
        "schema_version": None,
        "pending": None,
        "events_waiting": None,
        "outbox_pending": None,
    }
    try:
        with connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            version, lag = shard_rows.schema_version(conn), shard_rows.lag(conn)
        behind = pending(dsn, connect_timeout=CONNECT_TIMEOUT_S)
    except psycopg.OperationalError as exc:
        row["error"] = first_line(exc)
        return row
    row.update(reachable=True, schema_version=version, pending=behind)
    if lag is not None:
        row.update(events_waiting=lag.events_waiting, outbox_pending=lag.outbox_pending)
    return row


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def shards(ctx: click.Context, as_json: bool) -> None:
    """List the ledger's shards: partitions, reachable, schema version, what waits on each.

    Every shard is read, whichever does not answer; exit 3 when one does not (named on
    stderr). "events_waiting" counts events not yet done, "outbox_pending" deliveries not yet
    made: both read the queues only, never history. `vigil shards move` moves a partition."""
    if ctx.invoked_subcommand is not None:
        return
    settings = load_or_exit(CommonSettings)
    shard_map, source = _catalog_map(settings)
    rows = [
        _shard_row(i, dsn, shard_map.partitions_of(i, partitions=settings.partitions))
        for i, dsn in enumerate(shard_map.dsns)
    ]
    if as_json:
        emit({"map": source, "partitions": settings.partitions, "shards": rows}, True, "")
    else:
        shown = [
            {
                **r,
                "partitions": ",".join(map(str, r["partitions"])) or "(none)",
                "reachable": "yes" if r["reachable"] else "no",
                "schema": r["schema_version"],
            }
            for r in rows
        ]
        click.echo(f"map: {source}")
        table(
            shown,
            ["shard", "dsn", "partitions", "reachable", "schema", "events_waiting", "outbox_pending", "error"],
        )
    down = [r for r in rows if not r["reachable"]]
    if down:
        names = ", ".join(f"shard {r['shard']} ({r['dsn']}): {r['error']}" for r in down)
        click.echo(f"vigil: {len(down)} ledger shard(s) do not answer: {names}", err=True)
        sys.exit(EXIT_DEPENDENCY)


@shards.command("move")
@click.argument("partition", type=WholeNumber(0, INT_MAX))
@click.option(
    "--to", "target", type=WholeNumber(0, INT_MAX), required=True, help="The shard to move the partition's users to."
)
@click.option("--dry-run", is_flag=True, help="Print what would move, per table; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with --dry-run: the counts).")
def move(partition: int, target: int, dry_run: bool, as_json: bool) -> None:
    """Move PARTITION's users (every per-user table) to shard --to, then point the map there.

    The partition must be paused first (docs/operations.md, "Moving a partition to another
    shard"). Fences the partition on its shard, copies, verifies counts on both sides, changes
    the catalog's shard_map row, then deletes the source's rows. Interrupted, run it again: it
    carries on. Exit 2: an unknown partition or shard; 3: a shard does not answer; 4: the
    move cannot go on (the message says why)."""
    settings = load_or_exit(CommonSettings)
    args: dict = {"partition": partition, "target": target, "partitions": settings.partitions}
    try:
        if dry_run:
            _print_plan(shardmove.plan(settings.shard_dsns, topic=settings.events_topic, **args), as_json)
            return
        done = shardmove.move(
            settings.shard_dsns,
            topic=settings.events_topic,
            on_step=lambda step: click.echo(f"partition {partition}: {step}", err=as_json),
            **args,
        )
    except shardmove.UnknownName as exc:
        click.echo(f"vigil: {exc}", err=True)
        sys.exit(EXIT_STARTUP)
    except shardmove.MoveRefused as exc:
        click.echo(f"vigil: {exc}", err=True)
        sys.exit(EXIT_CONFLICT)
    if done.source == done.target:
        text = f"partition {partition} is already on shard {target}: nothing to move"
    else:
        text = f"partition {partition}: moved {done.users} user(s) from shard {done.source} to shard {done.target}"
    emit({"partition": partition, "source": done.source, "target": done.target, "users": done.users}, as_json, text)


def _print_plan(plan: shardmove.Plan, as_json: bool) -> None:
    rows = [{"table": t, "source_rows": s, "target_rows": d} for t, (s, d) in plan.rows.items()]
    if as_json:
        keys = ("partition", "source", "target", "state", "users")
        emit({**{k: getattr(plan, k) for k in keys}, "tables": rows, "dry_run": True}, True, "")
        return
    if plan.source == plan.target:
        click.echo(f"partition {plan.partition} is already on shard {plan.target}: nothing to move")
        return
    progress = f" (a move in progress: {plan.state})" if plan.state else ""
    click.echo(
        f"partition {plan.partition}: shard {plan.source} -> shard {plan.target}, {plan.users} user(s){progress}"
    )
    table(rows, ["table", "source_rows", "target_rows"])
    click.echo("dry run: nothing changed")


commands = [shards]
