""":func:`on_each_shard`, how an operator command runs one step on every shard, and
:class:`Shards`, how the operator commands and the console route to a user's shard, fan a list
out to every shard and merge it, and find the shard of an id (``vigil shards`` itself is
:mod:`vigil.ops.shards`).

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

from vigil.cliutil import INT_MAX, WholeNumber
from vigil.ledger.db import connect
from vigil.ledger.shardmap import ShardMap, ShardUnreachable
from vigil.ledger.shardpools import ShardRoutes
from vigil.service import EXIT_DEPENDENCY, first_line
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
