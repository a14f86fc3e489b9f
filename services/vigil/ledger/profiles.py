"""Agent profiles in the ledger (``queries/profiles.sql``): versions, assignments, and what a
worker reads to pick a run's profile (docs/agent.md, "Profiles").

A version is never changed: :func:`add_version` adds the next one, refused (``None``) when
the caller's view is stale, so two operators updating at once cannot both win silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class ProfileRow:
    name: str
    version: int
    spec: dict[str, Any]
    created_at: datetime
    created_by: str


@dataclass(frozen=True, slots=True)
class Assignment:
    pattern: str
    profile: str
    assigned_at: datetime


@dataclass(frozen=True, slots=True)
class Resolved:
    """An assignment with the latest version of its profile (what workers cache)."""

    pattern: str
    name: str
    version: int
    spec: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Pin:
    """The profile a session's latest run used (``name`` None: the default)."""

    name: str | None
    version: int | None


def _profile(row: DictRow) -> ProfileRow:
    return ProfileRow(row["name"], row["version"], row["spec"], row["created_at"], row["created_by"])


def add_version(
    conn: psycopg.Connection[DictRow], *, name: str, expect: int, spec: dict[str, Any], created_by: str
) -> ProfileRow | None:
    """Version ``expect + 1`` of ``name``; None when ``expect`` is not its latest version any more."""
    params = {"name": name, "expect": expect, "spec": Jsonb(spec), "created_by": created_by}
    row = conn.execute(Q.profiles_add_version, params).fetchone()
    return _profile(row) if row else None


def get(conn: psycopg.Connection[DictRow], name: str, version: int | None = None) -> ProfileRow | None:
    row = conn.execute(Q.profiles_get, {"name": name, "version": version}).fetchone()
    return _profile(row) if row else None


def history(conn: psycopg.Connection[DictRow], name: str) -> list[ProfileRow]:
    return [_profile(row) for row in conn.execute(Q.profiles_history, {"name": name})]


def latest(conn: psycopg.Connection[DictRow]) -> list[ProfileRow]:
    return [_profile(row) for row in conn.execute(Q.profiles_latest)]


def _assignment(row: DictRow) -> Assignment:
    return Assignment(row["pattern"], row["profile"], row["assigned_at"])


def assign(conn: psycopg.Connection[DictRow], *, pattern: str, profile: str) -> Assignment:
    row = conn.execute(Q.profiles_assign, {"pattern": pattern, "profile": profile}).fetchone()
    assert row is not None
    return _assignment(row)


def unassign(conn: psycopg.Connection[DictRow], pattern: str) -> Assignment | None:
    row = conn.execute(Q.profiles_unassign, {"pattern": pattern}).fetchone()
    return _assignment(row) if row else None


def assignments(conn: psycopg.Connection[DictRow]) -> list[Assignment]:
    return [_assignment(row) for row in conn.execute(Q.profiles_assignments)]


async def resolved(conn: psycopg.AsyncConnection[DictRow]) -> list[Resolved]:
    cur = await conn.execute(Q.profiles_resolved)
    return [Resolved(r["pattern"], r["name"], r["version"], r["spec"]) for r in await cur.fetchall()]


async def get_version(conn: psycopg.AsyncConnection[DictRow], *, name: str, version: int) -> dict[str, Any] | None:
    """The spec of one version (immutable: callers may keep it)."""
    cur = await conn.execute(Q.profiles_get, {"name": name, "version": version})
    row = await cur.fetchone()
    return row["spec"] if row else None


async def session_pin(conn: psycopg.AsyncConnection[DictRow], *, user_id: str, session_id: str) -> Pin | None:
    """The profile of the session's latest run; None when no run of it is recorded."""
    cur = await conn.execute(Q.profiles_session_pin, {"user_id": user_id, "session_id": session_id})
    row = await cur.fetchone()
    return Pin(row["profile"], row["profile_version"]) if row else None
