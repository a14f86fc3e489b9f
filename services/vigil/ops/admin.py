"""Ledger and topic administration: ``vigil migrate``, ``vigil topics``, ``vigil secrets``
(``vigil shards`` is :mod:`vigil.ops.shards`)."""

from __future__ import annotations

import json
import sys

import click

from vigil.admin.shards import on_each_shard
from vigil.bus.kafka import TopicError
from vigil.bus.topics import ensure
from vigil.cliutil import DecimalNumber, emit
from vigil.ledger import sealing, shards
from vigil.ledger.db import connect
from vigil.ledger.migrate import migrate as run
from vigil.ledger.migrate import pending
from vigil.ledger.shardmap import shown_dsn
from vigil.service import load_or_exit
from vigil.settings import CommonSettings


@click.command()
@click.option(
    "--check", is_flag=True, help="Apply nothing; exit 1 while migrations are pending (an init container's gate)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def migrate(check: bool, as_json: bool) -> None:
    """Apply the ledger's migrations on every shard (idempotent; safe from several replicas at once).

    Shard 0, the catalog, first; then each other shard, with the full schema (its catalog
    tables stay empty), whose identity sequences, until they give an id, start in a range of the
    shard's own (``vigil.ledger.shards.space_ids``). After the catalog's migrations, the shard
    map's rows of the configured partitions are seeded there. With one shard (VIGIL_LEDGER_SHARDS
    unset) it prints what it always printed."""
    settings = load_or_exit(CommonSettings)
    dsns = settings.shard_dsns
    if check:
        behind = on_each_shard(dsns, pending)
        rows = [
            {"shard": i, "dsn": shown_dsn(dsn), "up_to_date": not b, "pending": b}
            for i, (dsn, b) in enumerate(zip(dsns, behind))
        ]
        if len(dsns) == 1:
            only = behind[0]
            text = f"ledger is behind: {len(only)} pending ({', '.join(only)})" if only else "ledger is up to date"
        else:
            text = "\n".join(
                f"shard {i} {shown_dsn(dsn)}: " + (f"behind, {len(b)} pending ({', '.join(b)})" if b else "up to date")
                for i, (dsn, b) in enumerate(zip(dsns, behind))
            )
        up_to_date = not any(behind)
        emit({"up_to_date": up_to_date, "pending": behind[0], "shards": rows}, as_json, text)
        if not up_to_date:
            sys.exit(1)
        return
    applied = on_each_shard(dsns, run)
    for index, dsn in enumerate(dsns[1:], start=1):
        with connect(dsn, autocommit=True) as conn:
            shards.space_ids(conn, shard=index)
    with connect(dsns[0], autocommit=True) as conn:
        seeded = shards.seed(conn, partitions=settings.partitions, shards=len(dsns))
        # SQL cannot see the key: the secrets a migration left in clear (0029) are sealed here.
        # The catalog's only: hooks and channels live there.
        sealed = sealing.rotate(conn, sealing.keys()) if sealing.keys().current else 0
    if len(dsns) == 1:
        text = "applied: " + ", ".join(applied[0]) if applied[0] else "ledger is up to date"
    else:
        text = "\n".join(
            f"shard {i} {shown_dsn(dsn)}: " + ("applied: " + ", ".join(a) if a else "up to date")
            for i, (dsn, a) in enumerate(zip(dsns, applied))
        )
        text += f"\nshard map: {seeded} partition(s) placed by the rule" if seeded else ""
    text += f"; sealed {sealed} secret(s)" if sealed else ""
    rows = [{"shard": i, "dsn": shown_dsn(dsn), "applied": a} for i, (dsn, a) in enumerate(zip(dsns, applied))]
    emit({"applied": applied[0], "secrets_sealed": sealed, "shard_map_seeded": seeded, "shards": rows}, as_json, text)


@click.command()
@click.option(
    "--timeout", type=DecimalNumber(0, 3600), default=10.0, show_default=True, help="Seconds to wait for the broker."
)
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


@click.group("secrets")
def secrets_group() -> None:
    """Hook and channel secrets at rest, sealed with VIGIL_SECRET_KEY (docs/operations.md)."""


@secrets_group.command("new-key")
def secrets_new_key() -> None:
    """Print a new key for VIGIL_SECRET_KEY (keep it where the services' other secrets are)."""
    click.echo(sealing.new_key())


@secrets_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def secrets_status(as_json: bool) -> None:
    """How many secrets each key sealed, and which of those keys this shell holds."""
    settings = load_or_exit(CommonSettings)
    held = sealing.keys()
    with connect(settings.dsn, autocommit=True) as conn:
        uses = sealing.uses(conn)
    rows = [
        {
            "table": u.table,
            "sealed_with": u.sealed_with,
            "secrets": u.secrets,
            "held": u.sealed_with is None or u.sealed_with in held.ids,
        }
        for u in uses
    ]
    lines = [f"current key: {held.current_id or f'none ({sealing.KEY_SETTING} unset)'}"]
    for r in rows:
        key = r["sealed_with"] or "in clear"
        lines.append(f"{r['table']:<13} {key:<13} {r['secrets']:>6}{'' if r['held'] else '  (key not held)'}")
    emit({"current_key": held.current_id, "secrets": rows}, as_json, "\n".join(lines))


@secrets_group.command("rotate")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def secrets_rotate(as_json: bool) -> None:
    """Seal every secret with VIGIL_SECRET_KEY: those in clear and those sealed with a key of
    VIGIL_SECRET_OLD_KEYS. One row at a time: run it again if it was interrupted."""
    settings = load_or_exit(CommonSettings)  # first: a bad key is refused naming its variable
    held = sealing.keys()
    with connect(settings.dsn, autocommit=True) as conn:
        done = sealing.rotate(conn, held)
    emit({"resealed": done, "key": held.current_id}, as_json, f"sealed {done} secret(s) with key {held.current_id}")


commands = [migrate, topics, secrets_group]
