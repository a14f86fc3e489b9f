"""Bearer tokens for the HTTP API, and ledger reads that turn outages into 503s.

A token is shown once by ``vigil tokens create`` and stored as its sha256 only; ingest
hashes what a caller presents and looks the hash up. Unknown token: 401. Revoked: 403.
Lookups are cached for ``VIGIL_INGEST_AUTH_CACHE_S`` seconds (see :mod:`vigil.ingest.cache`),
which is therefore the longest a revoked token keeps working. Tokens are never logged.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.requests import Request

from vigil.ingest.cache import TtlCache
from vigil.ingest.requests import Refusal, unavailable
from vigil.ledger.queries import Q

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
async def ledger(pool: AsyncConnectionPool) -> AsyncIterator[psycopg.AsyncConnection]:
    """A pooled connection, one transaction; an unreachable ledger is a 503, never a 500."""
    try:
        async with pool.connection() as conn:
            conn.row_factory = dict_row
            yield conn
    except PoolTimeout:
        raise unavailable("ledger_unavailable", "no ledger connection available in time") from None
    except psycopg.OperationalError as exc:
        log.warning("ledger unreachable: %s", type(exc).__name__)
        raise unavailable("ledger_unavailable", "the ledger did not answer") from None


async def fetch_one(pool: AsyncConnectionPool, sql: str, params: dict[str, Any]) -> dict | None:
    async with ledger(pool) as conn:
        cursor = await conn.execute(sql, params)
        return await cursor.fetchone()


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made an authenticated request (the token's id and name, never the token)."""

    token_id: str
    name: str


def _unauthorized(detail: str) -> Refusal:
    return Refusal(401, "unauthorized", detail, headers={"WWW-Authenticate": 'Bearer realm="vigil"'})


class TokenAuth:
    """``await auth(request)`` returns the :class:`Caller` or raises a 401/403 refusal."""

    def __init__(self, pool: AsyncConnectionPool, cache_seconds: float):
        self.pool = pool
        self.cache: TtlCache[dict] = TtlCache(cache_seconds)

    async def __call__(self, request: Request) -> Caller:
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
        row = await self.cache.get(digest, lambda: fetch_one(self.pool, Q.token_by_hash, {"token_hash": digest}))
        if row is None:
            raise _unauthorized("unknown token")
        if row["revoked_at"] is not None:
            raise Refusal(403, "token_revoked", f"token {row['id']} was revoked")
        return Caller(row["id"], row["name"])
