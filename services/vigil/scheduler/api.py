"""The timers HTTP API, mounted on ingest (``vigil.ingest.mounts.MOUNTED``).

``routes(ctx)`` takes ingest's :class:`vigil.ingest.mounts.IngestContext`: ``authenticate``
(bearer token: 401/403), ``read_json`` (415/413/400), ``ledger()`` (a pooled connection with
dict rows, one transaction, 503 when the ledger is down) and ``Refusal``/``invalid`` (rendered
as ``{"error": code, "detail": ...}``). Validation is :func:`vigil.scheduler.timers.parse_timer`,
shared with `vigil timers add`, so a bad cron expression or zone is a 400 saying why.

- ``POST /v1/users/{user_id}/timers``: create (201) or re-register (200) a timer. A
  re-registration never fires an occurrence already fired (see :mod:`vigil.scheduler.timers`);
  when it changes nothing the 200 says so in ``note``.
- ``GET /v1/users/{user_id}/timers``: live timers in id order (``?all=true`` adds fired,
  skipped and cancelled ones; ``?limit=`` up to 1000, ``?after=<id>`` for the next page).
- ``GET /v1/users/{user_id}/timers/{timer_id}``: one timer.
- ``DELETE /v1/users/{user_id}/timers/{timer_id}``: cancel a live timer (204).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vigil.envelope import id_problem
from vigil.ledger import timers as ledger
from vigil.ledger.states import Scope, TimerKind
from vigil.numbers import NotParsed, whole_number
from vigil.scheduler.timers import TIMER_ID, InvalidTimer, describe, parse_timer

DEFAULT_PAGE = 100
# A quota frees up when one of the user's timers fires or is cancelled, which no client can
# see coming: a minute is a pace at which retrying costs nothing (every 429 says when).
QUOTA_RETRY_AFTER_S = 60
MAX_PAGE = 1000
COLLECTION = "/v1/users/{user_id}/timers"
ITEM = "/v1/users/{user_id}/timers/{timer_id}"


def routes(ctx: Any) -> list[Route]:
    async def authorized(request: Request, with_timer: bool = False) -> tuple[str, str | None]:
        """401/429 for the token, 400 for the ids, 403 unless the token may act for the user."""
        return (await authorized_caller(request, with_timer))[1:]

    async def authorized_caller(request: Request, with_timer: bool = False) -> tuple[Any, str, str | None]:
        """:func:`authorized`, and the caller (whose token the timer counts against)."""
        caller = await ctx.authenticate(request)
        user_id, timer_id = path_ids(request, with_timer)
        ctx.authorize(caller, Scope.TIMERS, user_id)
        return caller, user_id, timer_id

    def path_ids(request: Request, with_timer: bool = False) -> tuple[str, str | None]:
        user_id = request.path_params["user_id"]
        problem = id_problem(user_id)  # a %0A, %01 or %20 in the path: the one id rule
        if problem is not None:
            raise ctx.invalid("user_id", problem)
        timer_id = request.path_params.get("timer_id") if with_timer else None
        if with_timer and not TIMER_ID.match(timer_id or ""):
            # No such id can exist, so this is the same 404 as an unknown one.
            raise ctx.Refusal(404, "not_found", f"no timer {timer_id!r} for this user")
        return user_id, timer_id

    def over_quota(why: str) -> Exception:
        return ctx.Refusal(
            429, "quota_exceeded", f"{why}; cancel one first", headers={"Retry-After": str(QUOTA_RETRY_AFTER_S)}
        )

    async def create(request: Request) -> Response:
        caller, user_id, _ = await authorized_caller(request)
        body = await ctx.read_json(request)
        settings = ctx.settings
        try:
            timer = parse_timer(user_id, body, int(time.time()), min_every=settings.min_timer_every_s)
        except InvalidTimer as exc:
            raise ctx.invalid(exc.field, exc.reason) from None
        timer = replace(timer, token_id=caller.token_id)
        async with ctx.ledger(user_id) as conn:
            # Re-registering a timer is always allowed; only a new one counts against a quota.
            live = await ledger.quota_counts(conn, user_id=user_id, token_id=caller.token_id, other_than=timer.id)
            if live.of_user >= settings.max_timers_per_user:
                raise over_quota(f"the user has {settings.max_timers_per_user} live timers (VIGIL_MAX_TIMERS_PER_USER)")
            if live.of_token >= settings.timer_quota_per_token:
                raise over_quota(
                    f"this token has {settings.timer_quota_per_token} live timers over all users "
                    "(VIGIL_TIMER_QUOTA_PER_TOKEN)"
                )
            result = await ledger.upsert_async(conn, timer)
        if result.status == "conflict":
            raise ctx.Refusal(409, "conflict", result.reason)
        assert result.row is not None  # the upsert returned it or read it, in one transaction
        shown = {**describe(result.row), "status": result.status}
        if result.reason:
            shown["note"] = result.reason
        return JSONResponse(shown, status_code=201 if result.status == "created" else 200)

    async def list_timers(request: Request) -> Response:
        user_id, _ = await authorized(request)
        params = request.query_params
        include_done = params.get("all", "false").lower()
        if include_done not in {"true", "false", "1", "0"}:
            raise ctx.invalid("all", "expected true or false")
        try:
            limit = whole_number(params.get("limit", str(DEFAULT_PAGE)), 1, MAX_PAGE)
        except NotParsed as exc:
            raise ctx.invalid("limit", str(exc)) from None
        async with ctx.ledger(user_id) as conn:
            rows = await ledger.of_user_async(
                conn, user_id, include_done=include_done in {"true", "1"}, after=params.get("after", ""), limit=limit
            )
        timers = [describe(row) for row in rows]
        return JSONResponse({"timers": timers, "next_after": timers[-1]["id"] if len(timers) == limit else None})

    async def get_timer(request: Request) -> Response:
        user_id, timer_id = await authorized(request, with_timer=True)
        assert timer_id is not None  # path_ids(with_timer=True) refuses a missing one
        async with ctx.ledger(user_id) as conn:
            row = await ledger.get_async(conn, user_id=user_id, timer_id=timer_id)
        if row is None:
            raise ctx.Refusal(404, "not_found", f"no timer {timer_id!r} for this user")
        return JSONResponse(describe(row))

    async def cancel(request: Request) -> Response:
        user_id, timer_id = await authorized(request, with_timer=True)
        assert timer_id is not None  # path_ids(with_timer=True) refuses a missing one
        async with ctx.ledger(user_id) as conn:
            cancelled = await ledger.cancel_async(conn, user_id=user_id, timer_id=timer_id)
            row = None if cancelled else await ledger.get_async(conn, user_id=user_id, timer_id=timer_id)
        if cancelled:
            return Response(status_code=204)
        if row is None:
            raise ctx.Refusal(404, "not_found", f"no timer {timer_id!r} for this user")
        if row.kind == TimerKind.APPROVAL_EXPIRY:
            raise ctx.Refusal(
                409, "conflict", "an approval's expiry timer ends with its approval; answer the approval instead"
            )
        raise ctx.Refusal(404, "not_found", f"timer {timer_id!r} is not live (already fired, skipped or cancelled)")

    return [
        ctx.route(COLLECTION, create, methods=["POST"]),
        ctx.route(COLLECTION, list_timers, methods=["GET"]),
        ctx.route(ITEM, get_timer, methods=["GET"]),
        ctx.route(ITEM, cancel, methods=["DELETE"]),
    ]


_TIMER_SCHEMA = {
    "type": "object",
    "required": ["id"],
    "additionalProperties": False,
    "properties": {
        "id": {
            "type": "string",
            "pattern": TIMER_ID.pattern,
            "description": "Unique per user; re-posting it re-registers.",
        },
        "due": {
            "oneOf": [{"type": "integer"}, {"type": "string", "format": "date-time"}],
            "description": "First occurrence: epoch seconds or RFC 3339 with an offset. Optional for recurring timers.",
        },
        "every": {
            "type": "integer",
            "minimum": 1,
            "description": "Recur every this many seconds (at least VIGIL_MIN_TIMER_EVERY_S, 60 by default).",
        },
        "cron": {"type": "string", "description": "5-field cron expression, evaluated in tz."},
        "tz": {"type": "string", "default": "UTC", "description": "IANA time zone of the cron expression."},
        "catch_up": {"type": "string", "enum": ["coalesce", "each", "skip"], "default": "coalesce"},
        "max_lateness": {"type": "integer", "minimum": 0, "description": "Seconds; an older occurrence is skipped."},
        "payload": {"type": "object", "description": "Copied into every event the timer fires."},
    },
}


def openapi_paths() -> dict[str, Any]:
    """The timers API for ingest's ``/openapi.json``."""
    user = {"name": "user_id", "in": "path", "required": True, "schema": {"type": "string"}}
    timer = {"name": "timer_id", "in": "path", "required": True, "schema": {"type": "string"}}
    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    return {
        COLLECTION: {
            "post": {
                "summary": "Create or re-register a timer",
                "security": secured,
                "parameters": [user],
                "requestBody": {"required": True, "content": {"application/json": {"schema": _TIMER_SCHEMA}}},
                "responses": {
                    "201": {"description": "created"},
                    "200": {"description": "re-registered"},
                    "400": {"description": "invalid field (the detail says why)"},
                    "403": {"description": "the token may not manage this user's timers"},
                    "409": {"description": "the id belongs to an approval's expiry timer"},
                    "429": {
                        "description": "the user has VIGIL_MAX_TIMERS_PER_USER live timers, or the token "
                        "VIGIL_TIMER_QUOTA_PER_TOKEN over all users (Retry-After: 60)"
                    },
                },
            },
            "get": {
                "summary": "List a user's timers",
                "security": secured,
                "parameters": [
                    user,
                    {"name": "all", "in": "query", "schema": {"type": "boolean"}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "maximum": MAX_PAGE}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                ],
                "responses": {"200": {"description": "timers in id order, and next_after for the next page"}},
            },
        },
        ITEM: {
            "get": {
                "summary": "One timer",
                "security": secured,
                "parameters": [user, timer],
                "responses": {"200": {"description": "the timer"}, "404": {"description": "no such timer"}},
            },
            "delete": {
                "summary": "Cancel a live timer",
                "security": secured,
                "parameters": [user, timer],
                "responses": {
                    "204": {"description": "cancelled"},
                    "404": {"description": "no live timer"},
                    "409": {"description": "an approval's expiry timer"},
                },
            },
        },
    }
