"""`vigil tasks list|show|cancel`: background tasks for operators (docs/tasks.md).

An operator acts for every user, as that user: the owner-chain rule still holds on every call
(:func:`vigil.ledger.tasks.may_own`), so a row whose chain names neither its user nor its
creator is refused. The HTTP API (``/v1/tasks``) is the owner's way in. A cancel is recorded
in the task row (who asked, when) and in the audit table, in one transaction.
"""

from __future__ import annotations

import asyncio
import json

import click

from vigil.admin.shards import Shards, echo_rows, report_down, shard_option, with_shard
from vigil.cliutil import EXIT_CONFLICT, Conflict, WholeNumber, login_name, table
from vigil.ledger import audit
from vigil.ledger import tasks as ledger
from vigil.ledger.db import connect_async
from vigil.ledger.shardmap import ShardUnreachable
from vigil.service import load_or_exit
from vigil.settings import CommonSettings

COLUMNS = ["id", "user_id", "mode", "status", "attempts", "depth", "created_at", "finished_at", "error"]


def _shards() -> Shards:
    return Shards(load_or_exit(CommonSettings))


async def _connect(dsn: str):
    # A ledger that does not answer is one line and exit 3 (vigil.service.VigilGroup).
    return await connect_async(dsn, autocommit=True)


def _run(coro):
    return asyncio.run(coro)


def _refuse_unowned(row: ledger.TaskRow | None) -> None:
    """The owner-chain rule, the operator acting as the task's user (exit 1 when refused)."""
    if row is not None and not ledger.may_own(row, [row.user_id]):
        raise click.ClickException(
            f"task {row.id}: no owner to act as (its chain names neither its user nor its creator)"
        )


@click.group()
def tasks() -> None:
    """Background tasks delegated by agents: list, show, cancel."""


@tasks.command("list")
@click.option("--user", "user_id", default=None, help="Only this user's tasks.")
@click.option("--status", default=None, help="Only tasks in this status (queued, running, succeeded, ...).")
@click.option("--limit", type=WholeNumber(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def tasks_list(user_id: str | None, status: str | None, limit: int, as_json: bool) -> None:
    """Tasks, newest first: every shard's merged (--user: that user's shard)."""

    async def go(dsn: str):
        async with await _connect(dsn) as conn:
            if user_id:
                return await ledger.of_user(conn, user_id=user_id, status=status, limit=limit)
            return await ledger.recent(conn, status=status, limit=limit)

    shards = _shards()
    if user_id:
        shard = shards.of_user(user_id)
        found = [(shard, row) for row in shards.on(shard, lambda dsn: _run(go(dsn)))]
        down: list[ShardUnreachable] = []
    else:
        merged, down = shards.merged(lambda dsn: _run(go(dsn)), lambda r: (r.created_at, r.id), limit)
        found = [(f.shard, f.value) for f in merged]
    rows = [with_shard(row.as_json(), shard, shards) for shard, row in found]
    if as_json:
        echo_rows(rows)
    else:
        table(rows, (["shard"] if shards.many else []) + COLUMNS)
    report_down(down)


@tasks.command("show")
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="The row as one JSON object, with its parent and children.")
@shard_option
def tasks_show(task_id: str, as_json: bool, shard: int | None) -> None:
    """One task, every column, and its tree: its parent (a run or a task) and its children
    (sync and background, theirs too) with their status and usage."""

    async def go(dsn: str):
        async with await _connect(dsn) as conn:
            row = await ledger.get(conn, task_id)
            if row is None:
                return None
            parent = await ledger.get(conn, row.parent_task_id) if row.parent_task_id else None
            return row, parent, await ledger.children(conn, row.id)

    found = _shards().locate(lambda dsn: _run(go(dsn)), f"task {task_id}", shard)
    row, parent, descendants = found.value if found else (None, None, [])
    if row is None:
        raise click.ClickException(f"no task {task_id!r}")
    _refuse_unowned(row)
    kids: dict[str, list[ledger.TaskRow]] = {}
    for kid in descendants:
        kids.setdefault(kid.parent_task_id or "", []).append(kid)
    if as_json:
        up = {"run_key": row.parent_run_key} if parent is None else _node(parent, {})
        click.echo(json.dumps({**row.as_json(), "parent": up, "children": _node(row, kids)["children"]}))
        return
    for key, value in row.as_json().items():
        click.echo(f"{key:20} {value}")
    if row.progress_at is not None:
        click.echo(f"{'progress':20} {progress(row)}")
    click.echo(f"{'parent':20} " + (f"run {row.parent_run_key}" if parent is None else summary(parent)))
    click.echo(f"{'tree':20} {summary(row)}")
    for line in _drawn(row.id, kids, ""):
        click.echo(f"{'':20} {line}")


def summary(row: ledger.TaskRow) -> str:
    """A task in one line of its tree: id, mode, status, usage."""
    turns = f"{row.turns} turn{'s' if row.turns != 1 else ''}"
    return f"{row.id} {row.mode} {row.status} {turns}, {row.input_tokens + row.output_tokens} tokens"


def _drawn(task_id: str, kids: dict[str, list[ledger.TaskRow]], indent: str) -> list[str]:
    lines = []
    below = kids.get(task_id, [])
    for n, kid in enumerate(below):
        last = n == len(below) - 1
        lines.append(f"{indent}{'└─' if last else '├─'} {summary(kid)}")
        lines += _drawn(kid.id, kids, indent + ("   " if last else "│  "))
    return lines


def _node(row: ledger.TaskRow, kids: dict[str, list[ledger.TaskRow]]) -> dict:
    """A task in its tree as JSON: who it is, how it stands, what it spent, its children."""
    fields = ("id", "mode", "status", "depth", "turns", "input_tokens", "output_tokens", "started_at", "finished_at")
    out = {f: row.as_json()[f] for f in fields}
    out["children"] = [_node(kid, kids) for kid in kids.get(row.id, [])]
    return out


def progress(row: ledger.TaskRow) -> str:
    """A task's progress in one line: turns, tokens, last tool, note, when flushed."""
    turns = f"{row.turns} turn{'s' if row.turns != 1 else ''}"
    parts = [turns, f"{row.input_tokens + row.output_tokens} tokens", f"last tool {row.last_tool or '-'}"]
    if row.note:
        parts.append(f"note {row.note!r}")
    when = row.progress_at.isoformat() if row.progress_at else "-"
    return ", ".join(parts) + f" (as of {when})"


@tasks.command("cancel")
@click.argument("task_id")
@click.option("--actor", default=None, help="Who is cancelling (default: your login name).")
@click.option("--json", "as_json", is_flag=True, help="The task after the request, as one JSON object.")
@shard_option
def tasks_cancel(task_id: str, actor: str | None, as_json: bool, shard: int | None) -> None:
    """Cancel a task: at once if queued, at its next heartbeat if running (on its shard).

    Exits 4 if the task is already terminal (the API's 409), 1 if there is no such task."""
    who = actor or login_name()
    shards = _shards()

    async def find(dsn: str):
        async with await _connect(dsn) as conn:
            return await ledger.get(conn, task_id)

    place = shards.locate(lambda dsn: _run(find(dsn)), f"task {task_id}", shard) if shards.many else None

    async def go(dsn: str):
        async with await _connect(dsn) as conn:
            async with conn.transaction():
                _refuse_unowned(await ledger.get(conn, task_id))
                row = await ledger.cancel(conn, task_id=task_id, actor=who)
                if row is not None:
                    await audit.record_async(
                        conn, actor=who, action="task.cancel", detail={"task_id": task_id, "status": str(row.status)}
                    )
                return row, (await ledger.get(conn, task_id) if row is None else row)

    changed, row = shards.on(place.shard if place else (shard or 0), lambda dsn: _run(go(dsn)))
    if row is None:
        raise click.ClickException(f"no task {task_id!r}")
    if as_json:
        click.echo(json.dumps({"cancel_requested": changed is not None, **row.as_json()}))
        if changed is None:
            click.get_current_context().exit(EXIT_CONFLICT)
        return
    if changed is None and row.mode == "sync" and row.status == "running":
        raise Conflict(f"task {task_id} is a sync child: it ends with its run, not on its own")
    if changed is None:
        raise Conflict(f"task {task_id} is already {row.status}: nothing to cancel")
    if row.status == "cancelled":
        click.echo(f"task {task_id} cancelled (it had not started)")
    else:
        click.echo(f"task {task_id} is running: cancel requested, its worker stops it at its next heartbeat")


commands = [tasks]
