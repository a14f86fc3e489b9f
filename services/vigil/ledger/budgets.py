"""Daily token budgets in the ledger (``queries/budgets.sql``; docs/agent.md, "Budgets")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date, datetime
from typing import Protocol

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q

# How the provider bills prompt caching, relative to an input token (docs/agent.md, "Budgets").
CACHE_WRITE_WEIGHT = 1.25
CACHE_READ_WEIGHT = 0.1


class Tokens(Protocol):
    """What a run or a model call used (vigil.agent's Usage, a run's Budget)."""

    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def cache_read_tokens(self) -> int: ...
    @property
    def cache_write_tokens(self) -> int: ...


def billed(tokens: Tokens) -> int:
    """The billed tokens of ``tokens``, rounded up: the one weighting of a run's token cap and,
    through :func:`spent`'s weights, of the daily budget."""
    return math.ceil(
        tokens.input_tokens
        + tokens.output_tokens
        + CACHE_WRITE_WEIGHT * tokens.cache_write_tokens
        + CACHE_READ_WEIGHT * tokens.cache_read_tokens
    )


# How the error of an event waiting for its user's daily budget begins (the worker writes it;
# :func:`release` finds the waiting events by it).
WAITING_PREFIX = "budget: "


async def spent(conn: psycopg.AsyncConnection[DictRow], *, user_id: str, since: datetime) -> int:
    """Billed tokens of the user's runs started since ``since`` and of their ended background
    tasks (weighted as :func:`billed` weighs them), plus the token budget of each of their
    background tasks still open: held until the task ends, so that runs and tasks of one user
    working at once cannot together pass the day's budget by more than a call each."""
    weights = {"write_weight": CACHE_WRITE_WEIGHT, "read_weight": CACHE_READ_WEIGHT}
    cur = await conn.execute(Q.budgets_spent, {"user_id": user_id, "since": since} | weights)
    row = await cur.fetchone()
    return int(row["spent"]) if row else 0


async def notify_once(
    conn: psycopg.AsyncConnection[DictRow], *, user_id: str, day: date, profile: str, body: str
) -> bool:
    """Queue the day's notice for the user (an outbox row, run 0); False when already sent."""
    cur = await conn.execute(Q.budgets_notify_once, {"user_id": user_id, "day": day, "profile": profile, "body": body})
    return await cur.fetchone() is not None


@dataclass(frozen=True)
class Released:
    events: int  # waiting events made due now
    notices: int  # queued budget notices withdrawn (not yet sent)


def release(conn: psycopg.Connection[DictRow], *, profile: str, now: datetime | None = None) -> Released:
    """The events waiting for the daily budget of ``profile``'s users due now (its budget was
    changed), and those users' budget notices that no send has begun withdrawn: a notice saying
    "wait until tomorrow" must not go out after the wait was lifted. ``now``: the caller's
    clock (None: the database's)."""
    cur = conn.execute(Q.budgets_release, {"profile": profile, "prefix": WAITING_PREFIX, "now": now})
    row = cur.fetchone()
    return Released(int(row["released"]), int(row["withdrawn"])) if row else Released(0, 0)
