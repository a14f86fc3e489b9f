"""Dreaming in the ledger: typed functions over ``queries/dreams.sql`` (docs/agent.md, "Dreaming").

- :func:`schedule` queues a memory review (a task of kind ``memory_review``) for each user
  with enough new sessions since their last one; at most one is open per user, whoever
  calls it at once (a unique index, the insert's ``ON CONFLICT``).
- :func:`history` lists a user's memory changes; every write of the memory tool is one
  (``finish.write_memory`` records it in the same statement).
- :func:`revert` puts a change's old content back, only if the file still holds what the
  change wrote, and records the revert as a change of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow

from vigil.errors import VigilError
from vigil.ledger.queries import Q

REVIEW = "memory_review"  # tasks.kind of a memory review; delegated tasks are 'delegated'


class UnknownChange(VigilError):
    """No memory change has this id."""


class ChangedSince(VigilError):
    """The file no longer holds what the change wrote: reverting would lose a later change."""


@dataclass(frozen=True, slots=True)
class Scheduled:
    id: str
    user_id: str


@dataclass(frozen=True, slots=True)
class Change:
    id: int
    user_id: str
    path: str
    old_content: str | None  # None: the file did not exist
    new_content: str | None  # None: the file was deleted
    run_id: int | None
    task_id: str | None
    actor: str | None
    reverts: int | None
    at: datetime

    @classmethod
    def of(cls, row: dict[str, Any]) -> Change:
        return cls(**{f.name: row[f.name] for f in fields(cls)})

    def as_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["at"] = self.at.isoformat()
        return out


def schedule(
    conn: psycopg.Connection[DictRow],
    *,
    after_sessions: int,
    token_budget: int,
    timeout_s: float,
    max_attempts: int,
    now: datetime | None = None,
) -> list[Scheduled]:
    """Queue a review for every user with ``after_sessions`` (at least 1) sessions since
    their last review and none open; the reviews this call inserted."""
    assert after_sessions >= 1
    params = {
        "after": after_sessions,
        "token_budget": token_budget,
        "timeout_s": timeout_s,
        "max_attempts": max_attempts,
        "now": now,
    }
    cur = conn.execute(Q.review_schedule, params)
    return [Scheduled(r["id"], r["user_id"]) for r in cur.fetchall()]


def history(
    conn: psycopg.Connection[DictRow], *, user_id: str, before: int | None = None, limit: int = 100
) -> list[Change]:
    """The user's memory changes, newest first (``before``: ids below this one)."""
    cur = conn.execute(Q.memory_history_of_user, {"user_id": user_id, "before": before, "limit": limit})
    return [Change.of(r) for r in cur.fetchall()]


def change(conn: psycopg.Connection[DictRow], change_id: int) -> Change | None:
    """One memory change by id (None: not on this ledger)."""
    row = conn.execute(Q.memory_history_get, {"id": change_id}).fetchone()
    return None if row is None else Change.of(row)


def revert(conn: psycopg.Connection[DictRow], *, change_id: int, actor: str) -> Change:
    """Undo change ``change_id``: the file gets its old content back (deleted when the change
    created it). One statement, guarded by the file's current content, so a later change is
    never overwritten. Returns the revert's own change."""
    row = conn.execute(Q.memory_history_get, {"id": change_id}).fetchone()
    if row is None:
        raise UnknownChange(f"no memory change {change_id}")
    change = Change.of(row)
    params = {
        "user_id": change.user_id,
        "path": change.path,
        "content": change.old_content,
        "expected": change.new_content,
        "actor": actor,
        "reverts": change.id,
    }
    if change.new_content is None:
        statement = Q.memory_revert_recreate
    elif change.old_content is None:
        statement = Q.memory_revert_remove
    else:
        statement = Q.memory_revert_rewrite
    done = conn.execute(statement, params).fetchone()
    if done is None:
        raise ChangedSince(
            f"{change.path} of {change.user_id} has changed since change {change.id}: "
            "revert the later changes first (vigil memory history)"
        )
    return Change.of(done)
