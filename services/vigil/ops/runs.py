"""`vigil runs show RUN`: a run and its journaled steps, for operators (docs/worker.md,
"Durable runs").

RUN is a ``runs`` row id (a finished run) or a run key, ``<user>:<first event id>`` (a run in
flight has only its key: its journal is live until its finish). Steps of finished runs are
there while ``VIGIL_RUN_JOURNAL_DAYS`` keeps them.
"""

from __future__ import annotations

import dataclasses
import json

import click

from vigil.admin.shards import Shards, shard_option
from vigil.cliutil import BIGINT_MAX, table
from vigil.ledger import console as ledger_console
from vigil.ledger import journal as ledger_journal
from vigil.ledger import upgrades as ledger_upgrades
from vigil.ledger.db import connect
from vigil.numbers import NotParsed, whole_number
from vigil.service import LazyGroup, load_or_exit
from vigil.settings import CommonSettings

COLUMNS = ["step", "kind", "what", "epoch", "attempt", "recorded_at"]


# `runs replay` imports the agent (the Anthropic SDK): only when it runs, not for `runs show`.
SUBCOMMANDS = {"replay": "vigil.ops.replay", "upgrade": "vigil.ops.upgrade"}


@click.group(cls=LazyGroup, lazy=SUBCOMMANDS)
def runs() -> None:
    """Runs and their journaled steps."""


class RunRef(click.ParamType):
    """A run's id, or its key ``<user>:<first event id>``: ``int`` or a ``str`` key whose
    event id is ASCII digits in a bigint's range (``²``, ``١٢`` or 20 digits: a usage error,
    exit 2, never a traceback from ``int()`` or the ledger; issue 58)."""

    name = "RUN"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        user, colon, first = value.rpartition(":")
        try:
            number = whole_number(first, 1, BIGINT_MAX)
        except NotParsed as exc:
            self.fail(f"a run id or a key <user>:<first event id>: {exc}", param, ctx)
        return f"{user}:{number}" if colon else number


@runs.command("show")
@click.argument("run", type=RunRef())
@click.option("--json", "as_json", is_flag=True, help="The run and its steps as one JSON object.")
@shard_option
def runs_show(run: int | str, as_json: bool, shard: int | None) -> None:
    """A run (by id or key) and its steps. Exit 1 when there is no such run.

    A key names its user: the user's shard. An id counts per shard: the shard that has it."""
    shards = Shards(load_or_exit(CommonSettings))

    def read(dsn: str):
        with connect(dsn, autocommit=True) as conn:
            if isinstance(run, int):
                record = ledger_console.run(conn, run)
                if record is None:
                    return None
            else:
                user, _, first = run.rpartition(":")
                record = ledger_console.run_by_key(conn, user, int(first))
            key = f"{record.user_id}:{min(record.event_ids)}" if record is not None else str(run)
            moved = [dataclasses.asdict(u) for u in ledger_upgrades.of_run(conn, key)]
            return record, key, [s.view() for s in ledger_journal.steps(conn, key)], moved

    if isinstance(run, int):
        found = shards.locate(read, f"run {run}", shard)
        if found is None:
            raise click.ClickException(f"no run {run}")
        record, key, steps, moved = found.value
    else:
        user = run.rpartition(":")[0]
        at = shard if shard is not None else shards.of_user(user) if user else 0
        record, key, steps, moved = shards.on(at, read)
    if record is None and not steps:
        raise click.ClickException(f"no run {run} (no runs row, and no journal under that key)")
    out = {"run_key": key, "run": dataclasses.asdict(record) if record else None, "steps": steps, "upgrades": moved}
    if as_json:
        click.echo(json.dumps(out, default=str))
        return
    if record is not None:
        click.echo(f"run {record.id}: {record.user_id}, {record.outcome}, {record.turns} model turns, key {key}")
    else:
        click.echo(f"run {key}: in flight (no finish yet)")
    rows = [
        {
            **s,
            "what": (
                f"{', '.join(s['tools_called']) or s['text'][:40]} ({s['input_tokens']}+{s['output_tokens']} tokens)"
                if s["kind"] == "model"
                else f"{s['tool']} {s['idempotency_key']}: {s['outcome']}"
            ),
        }
        for s in steps
    ]
    table(rows, COLUMNS)
    for u in moved:  # `vigil runs upgrade`: the run takes the version at its next replay
        click.echo(
            f"moved from {u['profile']} v{u['from_version']} to v{u['to_version']} by {u['made_by']} at {u['made_at']}"
        )


commands = [runs]
