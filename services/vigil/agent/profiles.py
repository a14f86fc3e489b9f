"""Agent profiles: which model, prompt, limits, tools and budget a user's runs get
(docs/agent.md, "Profiles"; the ledger side is :mod:`vigil.ledger.profiles`).

A :class:`ProfileSpec` overrides the deployment's ``VIGIL_*`` settings field by field; what
it leaves out (``None``) stays as the deployment has it, so the default profile is the
settings themselves. Its ``tools`` is a tool set: only the tools it names are offered, each
with the permission it gives, whatever the agent has (built-ins, action tools, MCP tools
named ``<server>__<tool>``); a name the agent does not have is skipped.

:class:`ProfileBook` picks a run's profile on the worker: the assignments and the latest
version of each assigned profile are read together once per ``VIGIL_PROFILE_CACHE_S`` (one
query per worker, not per run), and a deployment with no assignment pays nothing more. A
run resuming a session keeps the version the session's latest run had (one read, only for
such a run and only when assignments exist), until the session ends.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import DictRow
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vigil.agent.base import RetryLater
from vigil.agent.settings import Permission, confined, parse_event_policies
from vigil.agent.tools import BUILTIN
from vigil.errors import VigilError
from vigil.ledger import profiles as ledger_profiles
from vigil.ledger.db import AsyncPool
from vigil.ttl_cache import TtlCache

log = logging.getLogger(__name__)

NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
# Tool names as the model sees them: built-ins and actions, and MCP tools as <server>__<tool>.
TOOL = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
PATTERN = re.compile(r"^[^*]{1,256}\*?$|^\*$")
DEFAULT = "default"  # the profile of users no assignment matches: the VIGIL_* settings
MAX_PINNED = 1000  # old versions kept in memory for resumed sessions


class ProfileRefused(VigilError):
    """A profile spec, name or pattern that is not valid; the message says why."""


class ProfileSpec(BaseModel):
    """What a profile overrides; ``None`` keeps the deployment's setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, min_length=1, max_length=200)
    system_prompt: str | None = Field(None, max_length=100_000)
    instructions_path: str | None = Field(None, pattern=r"^/memories/[A-Za-z0-9_./-]+$")
    max_turns: int | None = Field(None, ge=1, le=200)
    max_run_tokens: int | None = Field(None, ge=1000, le=10_000_000)
    run_wall_s: float | None = Field(None, gt=0, le=3600)
    tools: dict[str, Permission] | None = None
    mcp_servers: tuple[str, ...] = ()
    event_policies: str | None = None
    daily_tokens: int | None = Field(None, ge=0, le=10_000_000_000)

    @field_validator("instructions_path")
    @classmethod
    def _confined(cls, value: str | None) -> str | None:
        return None if value is None else confined(value)

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, value: dict[str, Permission] | None) -> dict[str, Permission] | None:
        for name in value or {}:
            if not TOOL.match(name):
                raise ValueError(f"{name!r} is not a tool name")
        return value

    @field_validator("mcp_servers")
    @classmethod
    def _server_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not NAME.match(name):
                raise ValueError(f"{name!r} is not an MCP server name (lower case, digits, _ and -)")
        return value

    @field_validator("event_policies")
    @classmethod
    def _policies(cls, value: str | None) -> str | None:
        if value is not None and "approval" in parse_event_policies(value):
            raise ValueError("approval events resume their own session and are always queued")
        return value

    def settings_update(self) -> dict[str, Any]:
        """The AgentSettings fields this profile overrides."""
        fields = ("model", "instructions_path", "max_turns", "max_run_tokens", "run_wall_s")
        return {f: getattr(self, f) for f in fields if getattr(self, f) is not None}

    def stored(self) -> dict[str, Any]:
        """The spec as the ledger keeps it: only what it sets."""
        return self.model_dump(mode="json", exclude_defaults=True)


def tool_set(permissions: dict[str, Permission], tools: dict[str, Permission]) -> dict[str, Permission]:
    """A profile's tool set (``tools``) over the agent's tools (``permissions``): only the
    tools it names that exist, with its permissions; a built-in can only be allowed or denied."""
    return {
        name: Permission.DENY if name in BUILTIN and p not in (Permission.ALLOW, Permission.DENY) else p
        for name, p in tools.items()
        if name in permissions
    }


def parse_spec(raw: dict[str, Any]) -> ProfileSpec:
    try:
        return ProfileSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "spec"
        raise ProfileRefused(f"{where}: {first['msg']}") from None


def check_name(name: str) -> str:
    if name == DEFAULT or not NAME.match(name):
        raise ProfileRefused(f"{name!r}: a profile name is lower case, digits, _ and - (and not {DEFAULT!r})")
    return name


def check_pattern(pattern: str) -> str:
    if not PATTERN.match(pattern):
        raise ProfileRefused(f"{pattern!r}: a user id, or a prefix ending in * (team-a/*); * only at the end")
    return pattern


def matches(pattern: str, user_id: str) -> bool:
    return user_id.startswith(pattern[:-1]) if pattern.endswith("*") else user_id == pattern


def most_specific(patterns: list[str], user_id: str) -> str | None:
    """The pattern that decides for ``user_id``: its exact id, else the longest prefix that matches."""
    if user_id in patterns:
        return user_id
    found = [p for p in patterns if p.endswith("*") and matches(p, user_id)]
    return max(found, key=len) if found else None


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    version: int
    spec: ProfileSpec


class Assignments:
    """The cached assignments: pattern -> the latest version of its profile."""

    def __init__(self, rows: list[ledger_profiles.Resolved]) -> None:
        self.by_pattern: dict[str, Profile] = {}
        for row in rows:
            try:
                spec = parse_spec(row.spec)
            except ProfileRefused as exc:
                # A row written by a newer vigil or by hand: its users get the default, loudly.
                log.warning("profile %s v%d ignored: %s", row.name, row.version, exc)
                continue
            self.by_pattern[row.pattern] = Profile(row.name, row.version, spec)
        self.patterns = list(self.by_pattern)

    def for_user(self, user_id: str) -> Profile | None:
        pattern = most_specific(self.patterns, user_id)
        return None if pattern is None else self.by_pattern[pattern]


class ProfileBook:
    """The worker's view of profiles (see the module doc). ``None`` from :meth:`for_run` is the
    default profile: the deployment's settings as they are."""

    def __init__(self, pool: AsyncPool, cache_s: float) -> None:
        self.pool = pool
        self.cache: TtlCache[Assignments] = TtlCache(cache_s)
        self.pinned: dict[tuple[str, int], ProfileSpec] = {}

    async def _load(self) -> Assignments:
        async with self.pool.connection() as conn:
            return Assignments(await ledger_profiles.resolved(conn))

    async def _table(self, fresh: bool = False) -> Assignments | None:
        """The assignments (None: there are none); ``fresh``: read now, not from the cache."""
        if fresh:
            self.cache.forget("assignments")
        table = await self.cache.get("assignments", self._load)
        return table if table is not None and table.patterns else None

    async def current(self, user_id: str, fresh: bool = False) -> Profile | None:
        """The user's profile by the assignments, never a session's pin: whose daily budget
        applies to them. ``fresh``: read from the ledger now, not from the cache."""
        table = await self._table(fresh)
        return table.for_user(user_id) if table is not None else None

    async def for_run(self, user_id: str, session_id: str | None) -> Profile | None:
        table = await self._table()
        if table is None:
            return None
        current = table.for_user(user_id)
        if session_id is None:
            return current
        async with self.pool.connection() as conn:
            pin = await ledger_profiles.session_pin(conn, user_id=user_id, session_id=session_id)
            if pin is None:
                return current  # no run of the session recorded: it starts with today's profile
            if pin.name is None or pin.version is None:
                return None  # the session began under the default profile: it keeps it
            if current is not None and (current.name, current.version) == (pin.name, pin.version):
                return current
            pinned = await self._version(conn, pin.name, pin.version)
        return current if pinned is None else pinned

    async def version(self, name: str, version: int) -> Profile | None:
        """One version of a profile (a background task runs with its delegating run's); None:
        the ledger has no such version."""
        if (name, version) in self.pinned:
            return Profile(name, version, self.pinned[name, version])
        async with self.pool.connection() as conn:
            return await self._version(conn, name, version)

    async def _version(self, conn: psycopg.AsyncConnection[DictRow], name: str, version: int) -> Profile | None:
        spec = self.pinned.get((name, version))
        if spec is None:
            raw = await ledger_profiles.get_version(conn, name=name, version=version)
            if raw is None:
                return None
            spec = parse_spec(raw)
            if len(self.pinned) >= MAX_PINNED:
                self.pinned.clear()
            self.pinned[name, version] = spec
        return Profile(name, version, spec)


async def resolve(book: ProfileBook | None, user_id: str, session_id: str | None) -> Profile | None:
    """The run's profile. The ledger unreadable is :class:`RetryLater`, never the default: a
    profile may narrow the tools, and running without it would widen them."""
    if book is None:
        return None
    try:
        return await book.for_run(user_id, session_id)
    except psycopg.Error as exc:
        raise RetryLater(f"profile lookup: {exc}") from exc
