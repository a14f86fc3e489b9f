"""`vigil memory history|revert`: every change of a user's memory files, and undoing one
(docs/agent.md, "Dreaming").

Each change (a run's finish, a memory review, an operator's revert) is a ``memory_history``
row with the old and the new content. A revert puts the old content back only if the file
still holds what the change wrote (else exit 4: revert the later changes first), and is
itself a change (``actor``, ``reverts``) and an audit row, in one transaction.
"""

from __future__ import annotations

import json

import click

from vigil.admin.shards import Shards, shard_option
from vigil.cliutil import Conflict, WholeNumber, login_name, table
from vigil.ledger import audit
from vigil.ledger import dreams as ledger
from vigil.ledger.db import connect
from vigil.service import load_or_exit
from vigil.settings import CommonSettings


def _shards() -> Shards:
    return Shards(load_or_exit(CommonSettings))


def _by(change: ledger.Change) -> str:
    if change.task_id:
        return f"task {change.task_id}"
    if change.run_id is not None:
        return f"run {change.run_id}"
    return f"{change.actor} (revert of {change.reverts})" if change.reverts else (change.actor or "-")


def _what(change: ledger.Change) -> str:
    if change.new_content is None:
        return "deleted"
    return "created" if change.old_content is None else "changed"


@click.group()
def memory() -> None:
    """The agent's memory files per user: their history, and undoing a change."""


@memory.command("history")
@click.argument("user_id")
@click.option("--limit", type=WholeNumber(1, 10_000), default=100, show_default=True)
@click.option("--before", type=WholeNumber(1), default=None, help="Only changes with ids below this one (paging).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per change, old and new content included.")
def memory_history(user_id: str, limit: int, before: int | None, as_json: bool) -> None:
    """A user's memory changes, newest first: who (run, task, operator), what, when (the
    user's shard: --before pages within it)."""

    def read(dsn: str) -> list[ledger.Change]:
        with connect(dsn, autocommit=True) as conn:
            return ledger.history(conn, user_id=user_id, before=before, limit=limit)

    changes = _shards().on_user(user_id, read)
    if as_json:
        for change in changes:
            click.echo(json.dumps(change.as_json()))
        return
    rows = [
        {"id": c.id, "at": c.at.isoformat(timespec="seconds"), "path": c.path, "what": _what(c), "by": _by(c)}
        for c in changes
    ]
    table(rows, ["id", "at", "path", "what", "by"])


@memory.command("revert")
@click.argument("change_id", type=WholeNumber(1))
@click.option("--actor", default=None, help="Who is reverting (default: your login name).")
@shard_option
def memory_revert(change_id: int, actor: str | None, shard: int | None) -> None:
    """Put back what change CHANGE_ID replaced (delete the file if the change created it).

    Exits 4 if the file has changed since (revert the later changes first), 1 if there is no
    such change. Change ids count per shard: the shard that has it (--shard: that one)."""
    who = actor or login_name()
    shards = _shards()
    place = (
        shards.locate(lambda dsn: _change(dsn, change_id), f"memory change {change_id}", shard) if shards.many else None
    )
    shards.on(place.shard if place else (shard or 0), lambda dsn: _revert(dsn, change_id, who))


def _change(dsn: str, change_id: int) -> ledger.Change | None:
    with connect(dsn, autocommit=True) as conn:
        return ledger.change(conn, change_id)


def _revert(dsn: str, change_id: int, who: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        try:
            with conn.transaction():
                done = ledger.revert(conn, change_id=change_id, actor=who)
                detail = {"change_id": change_id, "revert_id": done.id, "user_id": done.user_id, "path": done.path}
                audit.record(conn, actor=who, action="memory.revert", detail=detail)
        except ledger.UnknownChange as exc:
            raise click.ClickException(str(exc)) from None
        except ledger.ChangedSince as exc:
            raise Conflict(str(exc)) from None
    verb = "deleted" if done.new_content is None else "restored"
    click.echo(f"{done.path} of {done.user_id} {verb} (change {done.id} reverts {change_id})")


commands = [memory]
