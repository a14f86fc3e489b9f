"""What every ``vigil`` operator command does the same way: print created objects and tables,
name the person running it.

Its own module, below both ``vigil.cli`` (which imports every command module) and the command
modules, so that neither imports the other.
"""

from __future__ import annotations

import getpass
import json
from collections.abc import Callable
from typing import Any

import click

from vigil.envelope import id_problem
from vigil.errors import VigilError
from vigil.numbers import NotParsed, decimal_number, whole_number

INT_MAX = 2**31 - 1  # a ledger `integer` column (gaps, caps, seconds): past it PostgreSQL refuses
BIGINT_MAX = 2**63 - 1  # a ledger `bigint` (row ids, tokens): past it PostgreSQL refuses

# A command asked to change something whose state forbids it (a task already finished): the
# HTTP API's 409. Not 1, which is a command's other errors (no such task: the API's 404), nor
# 2 or 3 (vigil.service: a bad setting, a dependency down).
EXIT_CONFLICT = 4


class Conflict(VigilError, click.ClickException):
    """``Error: <message>`` on stderr and exit ``EXIT_CONFLICT``: the state forbids the change."""

    exit_code = EXIT_CONFLICT


class WholeNumber(click.ParamType):
    """A whole number from ``low`` to ``high``, parsed by :func:`vigil.numbers.whole_number`
    as the HTTP edges parse theirs: ASCII digits only, so ``²``, ``١٢``, `` 5`` and ``1_0``
    (which ``int()`` and Click's ``INT`` take or trip on) and 20 digits (which the ledger
    would refuse with a traceback) are a usage error: one line, exit 2 (issue 58)."""

    name = "integer"
    parse: Callable[[str, Any, Any], float] = staticmethod(whole_number)

    def __init__(self, low: float = 0, high: float = BIGINT_MAX):
        self.low, self.high = low, high

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high:
            return value  # a default
        try:
            return self.parse(str(value), self.low, self.high)
        except NotParsed as exc:
            self.fail(str(exc), param, ctx)


class DecimalNumber(WholeNumber):
    """Seconds and the like, with an optional fraction (``2.5``): ASCII digits and a point
    only; ``nan``, ``inf`` and ``1e9``, which ``float()`` takes, are a usage error."""

    name = "number"
    parse = staticmethod(decimal_number)


class UserId(click.ParamType):
    """A user id under the one id rule of every route (:func:`vigil.envelope.id_problem`): a
    command storing ``" b1"`` would make a lookalike of ``b1`` that no route can reach; a
    usage error instead, exit 2 (issue 58)."""

    name = "user"

    def convert(self, value, param, ctx):
        problem = id_problem(str(value))
        if problem is not None:
            self.fail(f"a user id {problem}", param, ctx)
        return str(value)


def emit(obj: dict, as_json: bool, text: str) -> None:
    """Print a created object: one JSON object with --json, else a human line."""
    click.echo(json.dumps(obj, default=str) if as_json else text)


def table(rows: list[dict], columns: list[str]) -> None:
    """Rows as aligned text columns, each cell cut at 60 characters; ``(none)`` for no rows."""
    if not rows:
        click.echo("(none)")
        return
    text = [[("" if row[c] is None else str(row[c])).replace("\n", " ")[:60] for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in text:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def login_name() -> str:
    """Who runs this command, for the audit trail (when no ``--actor`` names someone): the
    login name, or ``unknown`` where there is none (a container running as a numeric user
    without a passwd entry and without ``USER``, where ``getpass`` raises)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
