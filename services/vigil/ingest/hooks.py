"""``POST /v1/hooks/{hook_id}``: a provider's delivery, verified, then produced.

Order, and why: the hook is looked up (404 if unknown or disabled), the body is read under
the size bound (415/413), the signature is checked on those raw bytes against every active
secret (401), and only then is the body parsed (400) and the event produced (202 after the
broker's acknowledgement, 503 otherwise). Nothing reaches the broker unverified.

Each provider's delivery id is the event's ``source_id``, so the provider's retries of one
delivery are one ledger row. A hook's secrets are cached like tokens; a delivery that fails
against cached secrets older than a second is checked once more against fresh ones, so a
secret added by ``vigil hooks rotate`` works at once while revocation still takes effect
within ``VIGIL_INGEST_AUTH_CACHE_S``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vigil.envelope import Event, id_problem
from vigil.ingest.auth import ledger
from vigil.ingest.metrics import SIGNATURE_FAILURES, UNKNOWN_KEYS
from vigil.ingest.publisher import Publisher
from vigil.ingest.requests import Refusal, header_text, invalid, parse_json, read_body, received_at, require_json
from vigil.ingest.settings import IngestSettings
from vigil.ingest.signatures import VERIFIERS, SignatureError
from vigil.ledger import ingest as store
from vigil.ledger.db import AsyncPool
from vigil.ledger.ingest import Hook
from vigil.ledger.states import HookProvider
from vigil.numbers import NotParsed, unix_seconds
from vigil.ttl_cache import MissGuard, TtlCache

log = logging.getLogger(__name__)

# Fresh secrets are fetched again after a failed check only if the cached ones are older
# than this, so a stream of forged deliveries costs at most one query per hook per second.
RECHECK_AFTER_S = 1.0
MAX_ID_CHARS = 256  # delivery ids and event types: providers use a few dozen characters
MAX_HOOK_ID_CHARS = 64


def _header(request: Request, *names: str) -> str | None:
    """The first of the headers ``names`` present, as UTF-8 text (a 400 naming it if it is not)."""
    for name in names:
        value = header_text(request, name)
        if value:
            return value
    return None


def _clean(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise invalid(field, "missing or not a string")
    problem = id_problem(value, MAX_ID_CHARS)  # the one id rule: no edge space either
    if problem is not None:
        raise invalid(field, problem)
    return value


def _object(document: Any) -> dict:
    if not isinstance(document, dict):
        raise invalid("body", "expected a JSON object")
    return document


def delivery_event(provider: HookProvider, user_id: str, request: Request, body: bytes, document: Any) -> Event:
    """The event for one verified delivery: the provider's delivery id and event type."""
    headers = request.headers
    occurred_at = None
    if provider is HookProvider.GITHUB:
        source_id = _clean(_header(request, "X-GitHub-Delivery"), "X-GitHub-Delivery")
        event_type = _clean(_header(request, "X-GitHub-Event"), "X-GitHub-Event")
    elif provider is HookProvider.STRIPE:
        document = _object(document)
        source_id = _clean(document.get("id"), "id")
        event_type = _clean(document.get("type"), "type")
        if "created" in document:  # null too: a 400, not an event stored with no time (issue 58)
            try:
                occurred_at = unix_seconds(document["created"])
            except NotParsed as exc:
                raise invalid("created", str(exc)) from None
    else:
        source_id = _clean(_header(request, "webhook-id", "svix-id"), "webhook-id")
        given_type = document.get("type") if isinstance(document, dict) else None
        event_type = _clean(given_type, "type") if given_type is not None else "event"
    extra = {"traceparent": headers["traceparent"]} if "traceparent" in headers else {}
    return Event(
        user_id=user_id,
        source=provider.value,
        source_id=source_id,
        kind=f"{provider.value}.{event_type}",
        # As received: the agent sees exactly what the provider sent (and what was signed).
        payload=body.decode("utf-8"),
        received_at=received_at(request),
        occurred_at=occurred_at,
        headers=extra,
    )


class HookReceiver:
    def __init__(self, settings: IngestSettings, pool: AsyncPool, publisher: Publisher):
        self.settings = settings
        self.pool = pool
        self.publisher = publisher
        self.cache: TtlCache[Hook] = TtlCache(settings.ingest_auth_cache_s)
        self.misses = MissGuard(UNKNOWN_KEYS, "hook", self._all_ids)

    async def _all_ids(self) -> frozenset[str]:
        async with ledger(self.pool) as conn:
            return await store.hook_ids(conn)

    async def _lookup(self, hook_id: str) -> Hook | None:
        async with ledger(self.pool) as conn:
            return await store.hook_for_delivery(conn, hook_id)

    async def _hook(self, hook_id: str) -> Hook | None:
        if self.cache.age(hook_id) is None and not await self.misses.worth_looking_up(hook_id):
            self.misses.missed(looked_up=False)
            return None
        hook = await self.cache.get(hook_id, lambda: self._lookup(hook_id))
        if hook is None:
            self.misses.missed()
        return hook

    async def _verify(self, hook: Hook, provider: HookProvider, request: Request, body: bytes) -> None:
        verify = VERIFIERS[provider]
        tolerance = self.settings.webhook_tolerance_s
        try:
            verify(request.headers, body, hook.secrets, time.time(), tolerance)
            return
        except SignatureError as first:
            error = first
            age = self.cache.age(hook.id)
            if error.reason == SignatureError.MISMATCH and age is not None and age > RECHECK_AFTER_S:
                self.cache.forget(hook.id)
                fresh = await self._hook(hook.id)
                if fresh is not None and fresh.secrets != hook.secrets:
                    try:
                        verify(request.headers, body, fresh.secrets, time.time(), tolerance)
                        return
                    except SignatureError as second:
                        error = second
        SIGNATURE_FAILURES.labels(provider.value, error.reason).inc()
        raise Refusal(401, "invalid_signature", error.detail, reason=error.reason)

    async def post(self, request: Request) -> Response:
        hook_id = request.path_params["hook_id"]
        hook = await self._hook(hook_id) if len(hook_id) <= MAX_HOOK_ID_CHARS else None
        if hook is None or hook.disabled_at is not None:
            raise Refusal(404, "unknown_hook", "no such hook")
        provider = HookProvider(hook.provider)
        require_json(request)
        body = await read_body(request, self.settings.max_body_bytes)  # type: ignore[arg-type]  # set when validated
        if not hook.secrets:
            SIGNATURE_FAILURES.labels(provider.value, "no_active_secret").inc()
            raise Refusal(401, "invalid_signature", "the hook has no active secret", reason="no_active_secret")
        await self._verify(hook, provider, request, body)
        if provider is HookProvider.GITHUB and request.headers.get("x-github-event") == "ping":
            # GitHub's check that the hook is reachable: verified, but no agent should wake for it.
            return JSONResponse({"accepted": 0, "detail": "ping verified; nothing produced"}, 200)
        event = delivery_event(provider, hook.user_id, request, body, parse_json(body))
        await self.publisher.send([event], via="hooks")
        log.debug("hook %s: %s %s produced", hook_id, event.kind, event.source_id)
        return JSONResponse({"accepted": 1, "source": event.source, "source_id": event.source_id}, 202)
