"""The route modules other areas mount on ingest, and what ingest lends them.

Mounted: the scheduler's timers API (:mod:`vigil.scheduler.api`) and the background tasks'
API (:mod:`vigil.ingest.tasks_api`), listed in ``MOUNTED``. Each exports
``routes(ctx: IngestContext) -> list[Route]`` and ``openapi_paths() -> dict`` (merged into
``/openapi.json``). It gets the
ledger pool, the bearer-token check, the body reader with ingest's limits, and the refusal
type; ingest's middleware counts its requests and renders its refusals like its own.

    async def create_timer(request):
        caller = await ctx.authenticate(request)        # 401/403/429 or the Caller
        ctx.authorize(caller, Scope.TIMERS, user_id)    # 403 unless the token may act for user_id
        body = await ctx.read_json(request)             # 415/413/400 or the document
        async with ctx.ledger(user_id) as conn:         # the user's shard; 503 if it is down
            result = await upsert_async(conn, timer)  # committed when the block exits
        raise ctx.Refusal(409, "conflict", "...")       # -> {"error": "conflict", "detail": ...}
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import psycopg
from psycopg.rows import DictRow
from starlette.requests import Request
from starlette.routing import Route

from vigil.ingest import requests as _requests
from vigil.ingest import shards, tasks_api
from vigil.ingest.auth import Caller, TokenAuth, authorize, ledger, permits
from vigil.ingest.publisher import Publisher
from vigil.ingest.requests import unavailable
from vigil.ingest.settings import IngestSettings
from vigil.ingest.shards import AsyncShardPools
from vigil.ledger import db
from vigil.ledger.states import Scope
from vigil.scheduler import api as timers_api

T = TypeVar("T")

# The mounted modules, in the order their routes are tried.
MOUNTED = (timers_api, tasks_api)

# Checking out a connection waits at most this long before the caller gets a 503: a pool
# exhausted for longer is an incident, and the client should back off rather than pile up.
POOL_TIMEOUT_S = 5.0


class IngestContext:
    Refusal = _requests.Refusal
    invalid = staticmethod(_requests.invalid)
    received_at = staticmethod(_requests.received_at)
    route = staticmethod(_requests.route)  # a Route whose {ids} follow the one path rule
    permits = staticmethod(permits)  # may this token use scope S (for user U)? see vigil.ingest.auth
    authorize = staticmethod(authorize)  # the same, or a 403 refusal

    def __init__(self, settings: IngestSettings):
        self.settings = settings
        # Opened by the app's lifespan (not here: there is no event loop yet).
        self.pool = db.async_pool(settings.dsn, name="ingest", max_size=settings.ingest_db_pool, timeout=POOL_TIMEOUT_S)
        # The other shards' pools, for users' state (vigil.ingest.shards); made on first use.
        self.routes = shards.routes(settings)
        self.pools = AsyncShardPools(
            self.routes,
            self.pool,
            lambda dsn, shard: db.async_pool(
                dsn, name=f"ingest-{shard}", max_size=settings.ingest_db_pool, timeout=POOL_TIMEOUT_S
            ),
        )
        self.publisher = Publisher(settings)
        self.tokens = TokenAuth(
            self.pool, settings.ingest_auth_cache_s, settings.ingest_token_rate, settings.ingest_token_burst
        )

    async def authenticate(self, request: Request, scope: Scope | None = None, user_id: str | None = None) -> Caller:
        """The caller's bearer token: a :class:`Caller`, or a 401/403/429 refusal; with
        ``scope`` (and ``user_id``), also a 403 unless the token may do that."""
        return await self.tokens(request, scope, user_id)

    async def read_json(self, request: Request) -> Any:
        """The JSON body under ``VIGIL_MAX_BODY_BYTES``: 415, 413 or 400 refusals otherwise."""
        return await _requests.read_json(request, self.settings.max_body_bytes)  # type: ignore[arg-type]  # set when validated

    @asynccontextmanager
    async def ledger(self, user_id: str | None = None) -> AsyncIterator[psycopg.AsyncConnection[DictRow]]:
        """A pooled connection (dict rows) in one transaction on ``user_id``'s ledger shard (None:
        shard 0, the catalog: tokens, hooks, channels, the audit trail); a ledger outage is a 503."""
        if user_id is None or self.routes.count == 1:
            pool = self.pool
        else:
            try:
                pool = await self.pools.of_user(user_id)
            except psycopg.OperationalError:
                raise unavailable("ledger_unavailable", "the ledger's catalog did not answer") from None
        async with ledger(pool) as conn:
            yield conn

    @property
    def sharded(self) -> bool:
        """Several ledger shards: a user's state and the catalog are in different databases."""
        return self.routes.count > 1

    async def first_found(self, read: Callable[[psycopg.AsyncConnection[DictRow]], Awaitable[T | None]]) -> T | None:
        """``read`` on each shard in turn, for an id that names no user (a task's): the first
        thing found. A shard that does not answer before it is found is a 503."""
        for shard in range(self.routes.count):
            pool = self.pool if shard == 0 else await self.pools.open(shard)
            async with ledger(pool) as conn:
                if (found := await read(conn)) is not None:
                    return found
        return None


def mounted_routes(ctx: IngestContext) -> list[Route]:
    """Every mounted module's routes."""
    return [route for module in MOUNTED for route in module.routes(ctx)]


def mounted_openapi_paths() -> dict[str, Any]:
    """Every mounted module's OpenAPI paths (``/openapi.json`` and the committed ``openapi.json``)."""
    return {path: spec for module in MOUNTED for path, spec in module.openapi_paths().items()}
