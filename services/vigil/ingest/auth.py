"""Bearer tokens for the HTTP API, and ledger reads that turn outages into 503s.

A token is shown once by ``vigil tokens create`` and stored as its sha256 only; ingest
hashes what a caller presents and looks the hash up. Unknown token: 401. Revoked: 403.
Past its ``expires_at`` (``vigil tokens create --expires``): 401 ``token_expired``.
Lookups are cached for ``VIGIL_INGEST_AUTH_CACHE_S`` seconds (see :mod:`vigil.ttl_cache`),
which is therefore the longest a revoked token keeps working. Tokens are never logged.

A token may be scoped (route families, users it acts for): :func:`permits` is the one rule,
:func:`authorize` its 403. Each token is held to ``VIGIL_INGEST_TOKEN_RATE`` requests a
second per process (429 with ``Retry-After``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC

import psycopg
from psycopg.rows import DictRow
from starlette.requests import Request

from vigil.clock import Clock, SystemClock, utc
from vigil.ingest.metrics import UNKNOWN_KEYS
from vigil.ingest.requests import Refusal, unavailable
from vigil.ledger import ingest as store
from vigil.ledger.db import AsyncPool, PoolTimeout
from vigil.ledger.ingest import AuthToken
from vigil.ledger.states import Scope
from vigil.ttl_cache import MissGuard, TtlCache

log = logging.getLogger(__name__)

TOKEN_PREFIX = "vgl_"
# Far longer than any token vigil issues; a longer header is not a token, and hashing
# megabytes per request would be free work for an attacker.
MAX_TOKEN_CHARS = 512


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@asynccontextmanager
async def ledger(pool: AsyncPool) -> AsyncIterator[psycopg.AsyncConnection[DictRow]]:
    """A pooled connection (dict rows), one transaction; an unreachable ledger is a 503, never a 500."""
    try:
        async with pool.connection() as conn:
            yield conn
    except PoolTimeout:
        raise unavailable("ledger_unavailable", "no ledger connection available in time") from None
    except psycopg.OperationalError as exc:
        log.warning("ledger unreachable: %s", type(exc).__name__)
        raise unavailable("ledger_unavailable", "the ledger did not answer") from None


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made an authenticated request (the token's id and name, never the token), and
    what the token may do: ``scopes`` and ``users`` None mean unrestricted (every token
    created before scopes existed)."""

    token_id: str
    name: str
    scopes: frozenset[str] | None = None
    users: tuple[str, ...] | None = None


def permits(caller: Caller, scope: Scope | str, user_id: str | None = None) -> bool:
    """May ``caller`` use ``scope`` (and, given ``user_id``, act for that user)?

    The one place the rule lives: every route, and any later API (an operator console, a
    tasks API), asks here. ``admin`` includes every other scope. A ``users`` entry is an
    exact user id, or a prefix when it ends in ``*`` (``team-a/*``).
    """
    if caller.scopes is not None and str(scope) not in caller.scopes and Scope.ADMIN.value not in caller.scopes:
        return False
    if user_id is None or caller.users is None:
        return True
    for entry in caller.users:
        if entry.endswith("*") and user_id.startswith(entry[:-1]):
            return True
        if entry == user_id:
            return True
    return False


def authorize(caller: Caller, scope: Scope | str, user_id: str | None = None, field: str = "user_id") -> None:
    """:func:`permits`, or a 403 refusal saying which (nothing has been stored when it is raised)."""
    if permits(caller, scope, user_id):
        return
    if not permits(caller, scope):
        raise Refusal(403, "forbidden", f"token {caller.token_id} has no {scope} scope", scope=str(scope))
    raise Refusal(403, "forbidden", f"{field}: token {caller.token_id} may not act for this user", field=field)


def _unauthorized(detail: str, code: str = "unauthorized") -> Refusal:
    return Refusal(401, code, detail, headers={"WWW-Authenticate": 'Bearer realm="vigil"'})


def expired(row: AuthToken) -> Refusal:
    """The refusal of a token past its expiry (ingest's and the console's)."""
    when = row.expires_at.astimezone(UTC).isoformat(timespec="seconds") if row.expires_at else "?"
    return _unauthorized(f"token {row.id} expired at {when}", "token_expired")


class RateLimit:
    """A token bucket per API token: ``rate`` requests a second, bursts of ``burst``. Per
    process, so N replicas allow N times the rate; 0 turns it off."""

    def __init__(self, rate: float, burst: int):
        self.rate = rate
        self.burst = max(burst, 1)
        self._buckets: dict[str, tuple[float, float]] = {}  # token id -> (tokens, at)

    def take(self, key: str) -> float:
        """0 if a request may go now, else the seconds until one may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens - 1.0, now)
        return 0.0


class TokenAuth:
    """``await auth(request)`` returns the :class:`Caller` or raises a 401/403/429 refusal."""

    def __init__(
        self, pool: AsyncPool, cache_seconds: float, rate: float = 0.0, burst: int = 1, clock: Clock | None = None
    ):
        self.pool = pool
        self.clock = clock or SystemClock()
        self.cache: TtlCache[AuthToken] = TtlCache(cache_seconds)
        self.misses = MissGuard(UNKNOWN_KEYS, "token", self._all_hashes)
        self.limit = RateLimit(rate, burst)

    async def _all_hashes(self) -> frozenset[str]:
        async with ledger(self.pool) as conn:
            return await store.token_hashes(conn)

    async def _lookup(self, digest: str) -> AuthToken | None:
        async with ledger(self.pool) as conn:
            return await store.token_by_hash(conn, digest)

    async def __call__(self, request: Request, scope: Scope | str | None = None, user_id: str | None = None) -> Caller:
        header = request.headers.get("authorization")
        if not header:
            raise _unauthorized("missing Authorization: Bearer <token>")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("expected Authorization: Bearer <token>")
        if len(token) > MAX_TOKEN_CHARS:
            raise _unauthorized("unknown token")
        digest = token_hash(token)
        row = None
        looked_up = self.cache.age(digest) is not None or await self.misses.worth_looking_up(digest)
        if looked_up:
            row = await self.cache.get(digest, lambda: self._lookup(digest))
        if row is None:
            self.misses.missed(looked_up)
            raise _unauthorized("unknown token")
        if row.revoked_at is not None:
            raise Refusal(403, "token_revoked", f"token {row.id} was revoked")
        if row.expired(utc(self.clock.now())):
            raise expired(row)
        wait = self.limit.take(row.id)
        if wait > 0:
            raise Refusal(
                429,
                "rate_limited",
                f"token {row.id} is over VIGIL_INGEST_TOKEN_RATE; retry after the Retry-After seconds",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        scopes, users = row.scopes, row.users
        caller = Caller(
            row.id,
            row.name,
            None if scopes is None else frozenset(scopes),
            None if users is None else tuple(users),
        )
        if scope is not None:
            authorize(caller, scope, user_id)
        return caller
