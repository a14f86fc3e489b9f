"""The ingest ASGI application: routes, middleware, start-up and shutdown.

Start-up opens the ledger pools and the producer without waiting for either dependency:
ingest serves ``/healthz`` at once, ``/readyz`` says whether the broker and the ledger
answer, and requests that need a missing dependency get a 503 with ``Retry-After`` (never
a crash loop). Shutdown (SIGTERM) stops accepting, lets in-flight requests finish (their
produce waits included), then flushes and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vigil import tracing
from vigil.health import Readiness, dependency_checks, health_routes
from vigil.ingest import openapi
from vigil.ingest.approvals_api import ApprovalsApi, BeforeAnswer
from vigil.ingest.events_api import EventsApi
from vigil.ingest.hooks import HookReceiver
from vigil.ingest.metrics import RequestMetrics
from vigil.ingest.mounts import POOL_TIMEOUT_S, IngestContext, mounted_openapi_paths, mounted_routes
from vigil.ingest.requests import EXCEPTION_HANDLERS, TargetCheck, route
from vigil.ingest.settings import IngestSettings
from vigil.ingest.shards import SyncShardPools
from vigil.ledger import db

log = logging.getLogger(__name__)

# Approvals are rare next to events; a few connections serve them (see approvals_api).
APPROVALS_POOL_SIZE = 4


def create_app(settings: IngestSettings, *, before_answer: BeforeAnswer | None = None) -> Starlette:
    """The application. ``before_answer`` is a test hook (see :mod:`vigil.ingest.approvals_api`)."""
    ctx = IngestContext(settings)
    answers_pool = db.pool(settings.dsn, name="ingest-approvals", max_size=APPROVALS_POOL_SIZE, timeout=POOL_TIMEOUT_S)
    answers_pools = SyncShardPools(
        ctx.routes,
        answers_pool,
        lambda dsn, shard: db.pool(
            dsn, name=f"ingest-approvals-{shard}", max_size=APPROVALS_POOL_SIZE, timeout=POOL_TIMEOUT_S
        ),
    )
    answers = ApprovalsApi(settings, answers_pools, ctx.publisher, before_answer)
    events = EventsApi(settings, ctx.tokens, ctx.publisher, ctx.ledger, answers.answer_reply)
    hooks = HookReceiver(settings, ctx.pool, ctx.publisher)
    document = openapi.document(mounted_openapi_paths())

    async def openapi_json(_: Request) -> Response:
        return JSONResponse(document)

    routes = [
        route("/v1/events", events.post_events, methods=["POST"]),
        route("/v1/users/{user_id}/messages", events.post_message, methods=["POST"]),
        route("/v1/hooks/{hook_id}", hooks.post, methods=["POST"]),
        route("/v1/approvals/{request_id}", answers.post, methods=["POST"]),
        route("/v1/approvals/{request_id}/actions/{answer}", answers.post_action, methods=["POST"]),
        *mounted_routes(ctx),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        *health_routes(Readiness(dependency_checks(settings), gating=set())),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        await ctx.pool.open(wait=False)
        await asyncio.to_thread(answers_pool.open, wait=False)
        await ctx.publisher.start()
        # Everything allocated so far (modules, schemas, the app) lives as long as the
        # process: keep it out of the collector's full passes, which otherwise walked all of
        # it every few seconds under load and held every request up while they did.
        gc.freeze()
        log.info("ingest started (port %d)", settings.ingest_port)
        try:
            yield
        finally:
            await ctx.publisher.close()
            await asyncio.to_thread(answers_pools.close_others)
            await asyncio.to_thread(answers_pool.close)
            await ctx.pools.close_others()
            await ctx.pool.close()
            log.info("ingest stopped")

    middleware = [Middleware(RequestMetrics), Middleware(TargetCheck)]
    traced = tracing.asgi_middleware()
    if traced is not None:
        # Outermost: the server span is current for everything else, RequestMetrics included.
        middleware.insert(0, Middleware(traced[0], **traced[1]))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    return app
