"""``vigil shards``: each ledger shard, its partitions, whether it answers, its schema and what
waits on it; :func:`on_each_shard`, how an operator command runs one step on every shard; and
:class:`Shards`, how the operator commands and the console route to a user's shard, fan a list
out to every shard and merge it, and find the shard of an id.

Rules (docs/operations.md, "Several shards"): a command about a user reads the user's shard; a
list reads every shard, ``limit`` rows from each, merged in the list's own order (ties: shard 0
first) and cut at ``limit``, which is exactly the first ``limit`` rows of the union; a page's
cursor is one keyset per shard (:func:`page`). A list prints what the shards that answered
hold, then names each shard that did not (stderr) and exits 3. An id without a user in it
(event, run, task, change ids count per shard) is looked for on every shard: found on several,
the command asks for ``--shard``; found on none while a shard does not answer, it names that
shard. With one shard every command reads and prints what it always did.

docs/architecture.md, "Shards"; the map itself is :mod:`vigil.ledger.shardmap`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import click
import psycopg
from psycopg.rows import DictRow

from vigil.cliutil import EXIT_CONFLICT, INT_MAX, WholeNumber, emit, table
from vigil.ledger import shardmove
from vigil.ledger import shards as shard_rows
from vigil.ledger.db import connect
from vigil.ledger.migrate import pending
from vigil.ledger.shardmap import ShardMap, ShardMapError, ShardUnreachable, shown_dsn
from vigil.ledger.shardpools import ShardRoutes
from vigil.service import EXIT_DEPENDENCY, EXIT_STARTUP, StartupError, first_line, load_or_exit
from vigil.settings import CommonSettings

T = TypeVar("T")
R = TypeVar("R")

# A shard that does not answer in this long is reported unreachable; the others are still read.
CONNECT_TIMEOUT_S = 5


def on_each_shard(dsns: Sequence[str], step: Callable[[str], T]) -> list[T]:
    """``step(dsn)`` on every shard in order, shard 0 first. With several shards, one that does
    not answer stops the command with :class:`ShardUnreachable` naming it (exit 3); with one,
    the error is the ledger's as it always was (VIGIL_DATABASE_URL)."""
    results = []
    for index, dsn in enumerate(dsns):
        try:
            results.append(step(dsn))
        except psycopg.OperationalError as exc:
            if len(dsns) == 1:
                raise
            raise ShardUnreachable(index, dsn, first_line(exc)) from exc
    return results


@dataclass(frozen=True)
class Found(Generic[T]):
    """What one shard answered."""

    shard: int
    value: T


class Shards:
    """The shards an operator command (or the console) reads: a user's, every one, an id's.

    Every method takes a ``step(dsn)`` that opens its own connection, so sync and async
    ledger functions fit alike. A shard that does not answer is :class:`ShardUnreachable`
    (exit 3, named); with one shard the ledger's own error, as it always was."""

    def __init__(self, settings: CommonSettings, connect_timeout: int | None = CONNECT_TIMEOUT_S) -> None:
        self.dsns = settings.shard_dsns
        # The ledger's map (vigil.ledger.shardpools), read once per command: a moved partition's
        # users are where its row says. Commands connect per command: no pools.
        self.routes = ShardRoutes(self.dsns, partitions=settings.partitions, connect_timeout=connect_timeout)

    @property
    def many(self) -> bool:
        return len(self.dsns) > 1

    def shard_map(self) -> ShardMap:
        """The catalog's map, read once."""
        with self._catalog_named():
            return self.routes.shard_map()

    def of_user(self, user_id: str) -> int:
        """The shard of the user's home partition (one shard: 0, no map read)."""
        with self._catalog_named():
            return self.routes.shard_of_user(user_id)

    @contextmanager
    def _catalog_named(self) -> Iterator[None]:
        """A catalog that does not answer while the map is read is shard 0 unreachable (exit 3)."""
        try:
            yield
        except psycopg.OperationalError as exc:
            raise ShardUnreachable(0, self.dsns[0], f"the catalog (shard map): {first_line(exc)}") from exc

    def on(self, shard: int, step: Callable[[str], T]) -> T:
        """``step`` on one shard."""
        if not 0 <= shard < len(self.dsns):
            raise click.UsageError(f"--shard {shard}: VIGIL_LEDGER_SHARDS lists {len(self.dsns)} shard(s)")
        try:
            return step(self.dsns[shard])
        except psycopg.OperationalError as exc:
            if not self.many:
                raise
            raise ShardUnreachable(shard, self.dsns[shard], first_line(exc)) from exc

    def on_user(self, user_id: str, step: Callable[[str], T]) -> T:
        """``step`` on the shard of the user's home partition."""
        return self.on(self.of_user(user_id), step)

    @contextmanager
    def user_connection(self, user_id: str, *, autocommit: bool = True) -> Iterator[psycopg.Connection[DictRow]]:
        """A connection to the user's shard for one command, closed at the end (as
        vigil.admin.connection.cli_connection, which it is with one shard)."""
        with self.connection(self.of_user(user_id), autocommit=autocommit) as conn:
            yield conn

    @contextmanager
    def connection(self, shard: int, *, autocommit: bool = True) -> Iterator[psycopg.Connection[DictRow]]:
        """A connection to one shard for one command (shard 0: the catalog)."""
        try:
            with connect(self.dsns[shard], autocommit=autocommit) as conn:
                yield conn
        except psycopg.OperationalError as exc:
            if not self.many:
                raise
            raise ShardUnreachable(shard, self.dsns[shard], first_line(exc)) from exc

    def each(self, step: Callable[[str], T]) -> tuple[list[Found[T]], list[ShardUnreachable]]:
        """``step`` on every shard: what each that answered gave, and those that did not."""
        answers: list[Found[T]] = []
        down: list[ShardUnreachable] = []
        for shard in range(len(self.dsns)):
            try:
                answers.append(Found(shard, self.on(shard, step)))
            except ShardUnreachable as exc:
                down.append(exc)
        return answers, down

    def merged(
        self, step: Callable[[str], list[R]], key: Callable[[R], Any], limit: int
    ) -> tuple[list[Found[R]], list[ShardUnreachable]]:
        """A newest-first list from every shard: each shard's ``limit`` rows (``step``, sorted
        by ``key`` descending as its query sorts), merged by ``key`` and cut at ``limit``."""
        answers, down = self.each(step)
        return merge(answers, key, limit), down

    def locate(
        self, find: Callable[[str], T | None], what: str, shard: int | None = None, unique: bool = False
    ) -> Found[T] | None:
        """The shard holding ``what`` (``find`` gives None where it is not). ``shard`` pins it
        (``--shard``). Ids counted per shard may be on several: then the operator must say which.
        ``unique`` ids (UUIDs, random tokens) stop at the first shard that has them."""
        if shard is not None or not self.many:
            value = self.on(shard or 0, find)
            return None if value is None else Found(shard or 0, value)
        hits: list[Found[T]] = []
        down: list[ShardUnreachable] = []
        for index in range(len(self.dsns)):
            try:
                value = self.on(index, find)
            except ShardUnreachable as exc:
                down.append(exc)
                continue
            if value is not None:
                hits.append(Found(index, value))
                if unique:
                    return hits[0]
        if len(hits) > 1:
            raise click.UsageError(
                f"{what} is on shards {', '.join(str(h.shard) for h in hits)} (ids count per shard): give --shard N"
            )
        if down and not (hits and unique):
            if hits:
                raise ShardUnreachable(
                    down[0].shard,
                    self.dsns[down[0].shard],
                    f"{what} is on shard {hits[0].shard} and may be on this one too: give --shard {hits[0].shard}",
                )
            raise down[0]
        return hits[0] if hits else None


def merge(
    answers: Iterable[Found[list[R]]], key: Callable[[R], Any], limit: int, newest_first: bool = True
) -> list[Found[R]]:
    """Each shard's rows (sorted by ``key``, descending unless not ``newest_first``) as one
    list in that order, at most ``limit``; equal keys keep shard order."""
    rows = [Found(a.shard, row) for a in answers for row in a.value]
    return sorted(rows, key=lambda f: key(f.value), reverse=newest_first)[:limit]


def shard_option(function: Callable) -> Callable:
    """``--shard N`` for a command taking an id that counts per shard."""
    return click.option(
        "--shard",
        type=WholeNumber(0, INT_MAX),
        default=None,
        help="The ledger shard holding the id (asked for when the id is on several).",
    )(function)


def with_shard(row: dict, shard: int, shards: Shards) -> dict:
    """A row of a list, with its shard when there are several (one shard: unchanged)."""
    return {**row, "shard": shard} if shards.many else row


def echo_rows(rows: Iterable[dict]) -> None:
    """One JSON object per line."""
    for row in rows:
        click.echo(json.dumps(row, default=str))


def report_down(down: Sequence[ShardUnreachable]) -> None:
    """After a list: name each shard that did not answer (its rows are missing), exit 3."""
    if down:
        for exc in down:
            click.echo(f"vigil: {exc}; its rows are not listed", err=True)
        sys.exit(EXIT_DEPENDENCY)


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
