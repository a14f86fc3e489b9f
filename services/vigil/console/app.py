"""The console's ASGI application: pages, the login, the two retry actions.

Pages are rendered on the server by Jinja2 with autoescaping on for every template, so
whatever a payload, an error or a user id contains is shown as text. The responses also
carry a Content-Security-Policy that allows no script at all: the console needs none, and a
missed escape would still run nothing. Ledger reads go through :mod:`vigil.ledger.console`
only, on worker threads (psycopg's blocking calls stay off the event loop).

Several ledger shards (VIGIL_LEDGER_SHARDS): logins and tokens are read from shard 0 (the
catalog); a user's page from the user's shard; lists from every shard, merged in their order,
each row linking with ``?shard=N``, and a "next" link carrying one keyset per shard; an id
page without ``?shard`` shows the first shard that has the id (naming the others that do). A
shard that does not answer is named in a banner and the rest is shown (vigil.admin.shards).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode
from uuid import UUID

import psycopg
from jinja2 import Environment, FileSystemLoader, select_autoescape
from prometheus_client import Counter, Histogram
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from vigil.admin.shards import Found, Shards, merge
from vigil.clock import Clock, SystemClock, utc
from vigil.console import auth
from vigil.console.lag import EndOffsets, answered_at
from vigil.console.settings import ConsoleSettings
from vigil.dispatcher.operator import revive_delivery
from vigil.health import Readiness, dependency_checks, health_routes
from vigil.httpserver import HTTP_CODES, HostCheck, on_disconnect
from vigil.httpserver import Refusal as Refused  # the one refusal type, under the console's name
from vigil.ledger import console as ledger
from vigil.ledger import ingest as tokens
from vigil.ledger import journal as ledger_journal
from vigil.ledger import replays as ledger_replays
from vigil.ledger import sessions
from vigil.ledger.db import PoolTimeout
from vigil.ledger.events import retry_dead_events
from vigil.ledger.shardmap import ShardMap, ShardUnreachable, shown_dsn
from vigil.numbers import NotParsed, whole_number
from vigil.ttl_cache import MissGuard, TtlCache

log = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parent / "templates"
PAGE = 50  # rows per page of every list
TIMERS_SOON = timedelta(minutes=15)  # "due soon" on the timers page
MAP_REFRESH_S = 30  # how long the console routes by the shard map it read (several shards)
MAP_CONNECT_S = 5  # the catalog not answering the map's read in this long: the page says so
# A shard whose pool could not connect is shown down this long without waiting for it again:
# during an outage each page answers at once with the banner, not after the pool's timeout.
DOWN_HOLD_S = 5.0
MAX_RETRY_IDS = 100  # one form post retries at most this many events
LOGIN_FORM_S = 3600  # how long a login form's CSRF cookie lasts
SHOWN_CHARS = 60  # what a refusal echoes of an id the client sent
SECURITY_HEADERS = {
    # No script, no frames, no plugin, forms only to ourselves: the console needs nothing else.
    "content-security-policy": "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # Page addresses carry user ids: never hand them to another site.
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}

REQUESTS = Counter(
    "vigil_console_requests_total",
    "Console requests answered, by route template, method and status.",
    ["route", "method", "status"],
)
REQUEST_SECONDS = Histogram(
    "vigil_console_request_duration_seconds",
    "Time to answer a console request (the pages' ledger reads included), by route template.",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5),
)
UNKNOWN_KEYS = Counter(
    "vigil_console_unknown_keys_total",
    "Console requests with an unknown API token or session cookie, by kind (token, session) and whether the "
    "ledger was asked (looked_up false: answered from the set of existing keys during a flood).",
    ["kind", "looked_up"],
)
ACTIONS = Counter(
    "vigil_console_actions_total",
    "Operator actions taken from the console, by action (dead.retry, delivery.revive).",
    ["action"],
)


class Metrics:
    """Pure ASGI middleware: counts each response by route template (never a user id)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()
                ]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            template = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in ("GET", "HEAD", "POST") else "OTHER"
            REQUESTS.labels(template, method, str(status[0])).inc()
            REQUEST_SECONDS.labels(template).observe(time.perf_counter() - started)


def _ago(when: datetime | None, now: datetime | None = None) -> str:
    """'3m 12s ago' / 'in 40s': a human age next to every timestamp."""
    if when is None:
        return ""
    seconds = ((now or datetime.now(UTC)) - when).total_seconds()
    word = "ago" if seconds >= 0 else "from now"
    s = abs(int(seconds))
    text = f"{s}s" if s < 60 else f"{s // 60}m {s % 60}s" if s < 3600 else f"{s // 3600}h {s % 3600 // 60}m"
    if s >= 86_400:
        text = f"{s // 86_400}d {s % 86_400 // 3600}h"
    return f"{text} {word}"


def _when(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _pretty(text: str) -> str:
    """A JSON payload indented for reading; anything else as it came (escaped by the template)."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
    except (ValueError, TypeError):
        return text


# An approval question carries the signed answer token (vigil.ledger.approvals.sign_token:
# "v1." and 43 base64url characters): whoever reads it can answer for the user. The console
# shows the message without it; the user's channel got the real one.
APPROVAL_TOKEN = re.compile(r"\bv1\.[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")


def _redact(text: str) -> str:
    return APPROVAL_TOKEN.sub("v1.(answer token hidden)", text)


def shard_link(shards: int) -> Callable[..., str]:
    """A link's ``?shard=N``: the first shard given (a row's, then the page's); one shard: none."""

    def on(*candidates: Any) -> str:
        shard = next((c for c in candidates if isinstance(c, int)), None)
        return f"?shard={shard}" if shards > 1 and shard is not None else ""

    return on


def environment(shards: int = 1) -> Environment:
    # Autoescape every template whatever its extension: nothing here is meant to emit raw HTML.
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True))
    env.filters.update(ago=_ago, when=_when, pretty=_pretty, redact=_redact, q=lambda v: quote(str(v), safe=""))
    env.globals.update(on=shard_link(shards), many_shards=shards > 1)
    return env


class Sharded:
    """A row of a list read from several shards: the row's fields, and ``shard``."""

    def __init__(self, shard: int, row: Any) -> None:
        self.shard = shard
        self.row = row

    def __getattr__(self, name: str) -> Any:
        return getattr(self.row, name)


def _sharded(found: list[Found[Any]]) -> list[Sharded]:
    return [Sharded(f.shard, f.value) for f in found]


class Console:
    def __init__(self, settings: ConsoleSettings, clock: Clock | None = None):
        self.settings = settings
        self.clock = clock or SystemClock()
        secret = settings.secret_key.get_secret_value() if settings.secret_key is not None else None
        self.login_key = auth.login_key(secret)
        self.pool = ledger.open_pool(settings.dsn)
        self.shards = Shards(settings, connect_timeout=MAP_CONNECT_S)
        self.map_read_at = 0.0
        # Shard 0 is the catalog: its pool serves both.
        self.pools = [self.pool, *(ledger.open_pool(dsn) for dsn in settings.shard_dsns[1:])]
        self.down_until = [0.0] * len(self.pools)  # time.monotonic(): DOWN_HOLD_S after a failed connect
        self.connect_errors = [0] * len(self.pools)  # the pool's count at its last answer
        self.env = environment(len(self.pools))
        self.tokens: TtlCache[tokens.AuthToken] = TtlCache(settings.console_auth_cache_s)
        self.sessions: TtlCache[sessions.Session] = TtlCache(settings.console_auth_cache_s)
        # As ingest's: a flood of made-up tokens or cookies costs at most one query a second.
        self.token_misses = MissGuard(UNKNOWN_KEYS, "token", lambda: self.read(tokens.all_token_hashes))
        self.session_misses = MissGuard(
            UNKNOWN_KEYS, "session", lambda: self.read(sessions.live_hashes, utc(self.clock.now()))
        )
        self.end_offsets = EndOffsets(settings)

    # -- plumbing --------------------------------------------------------------------------

    async def read(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run one ledger function on a pooled connection of the catalog (shard 0), off the event loop."""
        return await self.read_on(0, fn, *args, **kwargs)

    async def read_on(self, shard: int, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run one ledger function on a pooled connection of ``shard``, off the event loop."""

        def call():
            with self.pools[shard].connection() as conn:
                return fn(conn, *args, **kwargs)

        where = f"ledger shard {shard}" if len(self.pools) > 1 else "ledger"
        if time.monotonic() < self.down_until[shard]:
            raise Refused(503, "ledger_unavailable", f"the {where} did not answer (tried again in a few seconds)")
        try:
            answer = await run_in_threadpool(call)
        except PoolTimeout:
            # No connection in time: the pool could not connect (down: hold), or every
            # connection was busy (no hold: the next request may get one).
            if self._connect_errors(shard) > self.connect_errors[shard]:
                self.down_until[shard] = time.monotonic() + DOWN_HOLD_S
                raise Refused(503, "ledger_unavailable", f"the {where} did not answer") from None
            raise Refused(503, "ledger_unavailable", f"no {where} connection available in time") from None
        except psycopg.OperationalError as exc:
            log.warning("%s unreachable: %s", where, type(exc).__name__)
            self.down_until[shard] = time.monotonic() + DOWN_HOLD_S
            raise Refused(503, "ledger_unavailable", f"the {where} did not answer") from None
        self.connect_errors[shard] = self._connect_errors(shard)
        return answer

    def _connect_errors(self, shard: int) -> int:
        """The shard's pool's failed connection attempts so far (psycopg_pool's own count)."""
        return int(self.pools[shard].get_stats().get("connections_errors", 0))

    async def read_each(self, fn: Callable[..., Any], *args, **kwargs) -> tuple[list[Found[Any]], list[str]]:
        """``fn`` on every shard at once: what each that answered gave, and a line naming each
        that did not (the page's banner). With one shard its refusal is the page's, as before."""
        if len(self.pools) == 1:
            return [Found(0, await self.read_on(0, fn, *args, **kwargs))], []
        answers = await asyncio.gather(*(self._answer(i, fn, *args, **kwargs) for i in range(len(self.pools))))
        return [a for a in answers if isinstance(a, Found)], [a for a in answers if isinstance(a, str)]

    async def _answer(self, shard: int, fn: Callable[..., Any], *args, **kwargs) -> Found[Any] | str:
        try:
            return Found(shard, await self.read_on(shard, fn, *args, **kwargs))
        except Refused:
            dsn = shown_dsn(self.settings.shard_dsns[shard])
            return f"Ledger shard {shard} ({dsn}) did not answer: its rows are not shown."

    async def shard_map(self) -> ShardMap:
        """The catalog's shard map, read again at most every MAP_REFRESH_S (a partition moved
        between shards shows on its new shard within that)."""
        if time.monotonic() - self.map_read_at > MAP_REFRESH_S:
            self.shards = Shards(self.settings, connect_timeout=MAP_CONNECT_S)
            try:
                await run_in_threadpool(self.shards.shard_map)
            except ShardUnreachable:
                raise Refused(503, "ledger_unavailable", "the catalog (ledger shard 0) did not answer") from None
            self.map_read_at = time.monotonic()
        return self.shards.shard_map()

    async def user_shard(self, user_id: str) -> int:
        """The shard of the user's home partition."""
        if len(self.pools) == 1:
            return 0
        return (await self.shard_map()).shard_of_user(user_id, partitions=self.settings.partitions)

    async def find(self, request: Request, fn: Callable[..., Any], *args) -> tuple[int, Any, list[str]]:
        """An id's page: the shard ``?shard=N`` names, else the first that has it (the banner
        names the others that do, and those that did not answer)."""
        pinned = _shard_param(request.query_params.get("shard"), len(self.pools) - 1)
        if pinned is not None:
            return pinned, await self.read_on(pinned, fn, *args), []
        found, down = await self.read_each(fn, *args)
        hits = [f for f in found if f.value]
        if not hits:
            return 0, None, down
        others = [f"Shard {h.shard} has this id too: add ?shard={h.shard} to see that one." for h in hits[1:]]
        return hits[0].shard, hits[0].value, others + down

    async def page_each(
        self, fn: Callable[..., list], key: Callable[[Any], tuple], cursor: tuple[str | None, int, Callable], *args
    ) -> tuple[list[Sharded], str | None, list[str]]:
        """One page of a list from every shard, merged by ``key`` (the list's keyset; newest
        first unless the list runs forward: then ``key`` is its keyset's order too). The "next"
        cursor holds one keyset per shard: each shard's next page starts after the last of its
        rows shown, so no row is skipped or shown twice, whatever the shards' ids."""
        text, parts, last = cursor
        keysets = _keysets(text, len(self.pools), last, parts)
        answers = await asyncio.gather(*(self._answer(i, fn, *args, keysets[i], PAGE) for i in range(len(self.pools))))
        rows = merge([a for a in answers if isinstance(a, Found)], key, PAGE, newest_first=fn not in FORWARD)
        nxt = None
        if len(rows) == PAGE:
            for r in rows:
                keysets[r.shard] = key(r.value)
            nxt = json.dumps([None if k is None else _pieces(*k) for k in keysets], separators=(",", ":"))
        return _sharded(rows), nxt, [a for a in answers if isinstance(a, str)]

    def page(self, request: Request, template: str, status: int = 200, **context) -> HTMLResponse:
        operator = request.scope.get("vigil.operator")
        html = self.env.get_template(template).render(
            request=request, operator=operator, now=utc(self.clock.now()), csrf_field=auth.CSRF_FIELD, **context
        )
        return HTMLResponse(html, status_code=status)

    def refused(self, request: Request, exc: Refused) -> Response:
        if "text/html" in request.headers.get("accept", ""):
            return self.page(request, "error.html", exc.status, error=exc)
        headers = {"retry-after": "5"} if exc.status == 503 else None
        return JSONResponse({"error": exc.code, "detail": exc.detail}, exc.status, headers=headers)

    async def token(self, token: str) -> tokens.AuthToken | None:
        """The token's row (cached), or None if unknown; the miss guard bounds what unknown
        tokens cost the ledger."""
        digest = auth.digest(token)
        if digest is None:
            return None
        return await self.token_misses.get(self.tokens, digest, lambda: self.read(tokens.auth_token, digest))

    async def operator(self, request: Request, need: auth.Need) -> auth.Operator:
        """The authenticated operator, or Refused (401/403). Sets it on the request for templates.

        An ``Authorization`` header, whatever it holds, is the request's only credential;
        without one, the session cookie is."""
        header = request.headers.get("authorization")
        now = utc(self.clock.now())
        if header is not None:
            token = auth.bearer(header)
            if token is None:
                raise Refused(401, "unauthorized", "expected Authorization: Bearer <token>")
            row = await self.token(token)
            if row is None:
                raise Refused(401, "unauthorized", "unknown token")
            held = auth.Operator(row.id, row.name, "", _frozen(row.scopes), _tuple(row.users))
            revoked_at, expired = row.revoked_at, row.expired(now)
        else:
            key = auth.session_hash(request.cookies.get(auth.COOKIE, ""))
            if key is None:
                raise Refused(401, "unauthorized", "log in with an API token (vigil tokens create NAME)")
            found = await self.session_misses.get(self.sessions, key, lambda: self.read(sessions.by_hash, key))
            if found is None or not found.live(now):
                raise Refused(401, "unauthorized", "the session has ended: log in again")
            held = auth.Operator(
                found.token_id, found.name, found.csrf, _frozen(found.scopes), _tuple(found.users), session=key
            )
            revoked_at = found.revoked_at
            expired = found.token_expires_at is not None and now >= found.token_expires_at
        if revoked_at is not None:
            raise Refused(403, "token_revoked", f"token {held.token_id} was revoked")
        if expired:
            raise Refused(401, "token_expired", f"token {held.token_id} has expired")
        if not auth.permits(held, need):
            raise Refused(403, "forbidden", f"token {held.token_id} may not {need.value} here")
        request.scope["vigil.operator"] = held
        return held

    async def form_action(self, request: Request) -> tuple[auth.Operator, Any]:
        """A POST: a WRITE operator, and for a session (a cookie) its CSRF value back. A bearer
        header needs none: no other site's form can set one."""
        operator = await self.operator(request, auth.Need.WRITE)
        form = await request.form()
        if operator.session is not None and not auth.same(operator.csrf, form.get(auth.CSRF_FIELD)):
            raise _csrf_refusal()
        return operator, form

    # -- login -----------------------------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        """The form, with a fresh double-submit CSRF value in a cookie and in the form."""
        target = _safe_next(request.query_params.get("next"))
        return self.login_page(request, target, None)

    def login_page(self, request: Request, target: str, failed: str | None, status: int = 200) -> Response:
        csrf = auth.new_login_csrf(self.login_key, self.clock.now())
        response = self.page(request, "login.html", status, next=target, failed=failed, login_csrf=csrf)
        _cookie(response, request, auth.LOGIN_COOKIE, csrf, LOGIN_FORM_S, path="/login")
        return response

    async def login(self, request: Request) -> Response:
        """Check the form's CSRF value and the token, then make a session.

        Steps: the session row is committed (with a sweep of expired ones) before the cookie
        is sent; a crash between them leaves a session nobody holds, which expires."""
        form = await request.form()
        target = _safe_next(str(form.get("next", "/")))
        pair = (request.cookies.get(auth.LOGIN_COOKIE), form.get(auth.CSRF_FIELD))
        if not auth.login_csrf_ok(self.login_key, *pair, self.clock.now(), LOGIN_FORM_S):
            return self.login_page(request, target, "The login form expired: try again.", 403)
        token = str(form.get("token", "")).strip()
        row = await self.token(token) if token else None
        now = utc(self.clock.now())
        failed = None
        if row is None:
            failed = "That token is not valid."
        elif row.revoked_at is not None:
            failed = "That token was revoked."
        elif row.expired(now):
            failed = "That token has expired."
        elif not auth.may_log_in(row):
            failed = (
                "That token may not use the console: it needs the admin scope and no user restriction "
                "(vigil tokens create NAME --scope admin)."
            )
        if row is None or failed is not None:
            status = 403 if row is not None and failed and "may not" in failed else 401
            return self.login_page(request, target, failed, status)
        session_id = auth.new_session_id()
        ends = now + timedelta(seconds=self.settings.console_session_s)
        if row.expires_at is not None:
            ends = min(ends, row.expires_at)
        key = auth.session_hash(session_id)
        await self.read(sessions.create, id_hash=key, token_id=row.id, csrf=auth.new_csrf(), now=now, expires_at=ends)
        response = RedirectResponse(target, status_code=303)
        _cookie(response, request, auth.COOKIE, session_id, max(1, int((ends - now).total_seconds())))
        response.delete_cookie(auth.LOGIN_COOKIE, path="/login")
        return response

    async def logout(self, request: Request) -> Response:
        """End the session in the ledger (the cookie alone would outlive a deleted cookie) and
        drop the cookie. Needs the session's CSRF value: no other site can log an operator out."""
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict")
        key = auth.session_hash(request.cookies.get(auth.COOKIE, ""))
        found = None if key is None else await self.read(sessions.by_hash, key)
        if key is None or found is None or not found.live(utc(self.clock.now())):
            return response  # nothing to end
        form = await request.form()
        if not auth.same(found.csrf, form.get(auth.CSRF_FIELD)):
            raise _csrf_refusal()
        await self.read(sessions.end, key, utc(self.clock.now()))
        self.sessions.forget(key)
        return response

    # -- pages -----------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        found, banners = await self.read_each(ledger.overview, now=utc(self.clock.now()))
        if not found:
            raise Refused(503, "ledger_unavailable", " ".join(banners))
        data = found[0].value if len(self.pools) == 1 else _combined(found)
        return self.page(request, "overview.html", o=data, banners=banners)

    async def search(self, request: Request) -> Response:
        """One box: a run id, a delivery id, a user id or a source id; the first that exists wins
        (ids on the first shard that has them; a user on the user's shard)."""
        await self.operator(request, auth.Need.READ)
        q = request.query_params.get("q", "").strip()[:500]
        kind = request.query_params.get("kind", "any")
        user_id = request.query_params.get("user") or None
        if not q or not _storable(q, user_id):  # NUL: no ledger text can hold it, so nothing matches
            return self.page(request, "search.html", q=q, kind=kind, events=[], tried=[] if not q else ["anything"])
        tried = []
        number = _ledger_id(q)
        on = shard_link(len(self.pools))
        if kind in ("any", "run") and number is not None:
            shard, found, _ = await self.find(request, ledger.run, number)
            if found:
                return RedirectResponse(f"/runs/{number}{on(shard)}", status_code=303)
        if kind in ("any", "event") and number is not None:
            shard, found, _ = await self.find(request, ledger.event, number)
            if found:
                return RedirectResponse(f"/events/{number}{on(shard)}", status_code=303)
        if kind in ("any", "delivery"):
            with contextlib.suppress(ValueError):
                shard, found, _ = await self.find(request, ledger.delivery, UUID(q))
                if found:
                    return RedirectResponse(f"/deliveries/{UUID(q)}{on(shard)}", status_code=303)
            tried.append("delivery id")
        if kind in ("any", "user") and await self.read_on(await self.user_shard(q), ledger.user, q):
            return RedirectResponse(f"/users/{quote(q, safe='')}", status_code=303)
        events: list = []
        banners: list[str] = []
        if kind in ("any", "source_id"):
            if len(self.pools) == 1:
                events = await self.read(ledger.events_by_source_id, source_id=q, user_id=user_id)
            else:
                home = await self.user_shard(user_id) if user_id is not None else None
                found, banners = await self.read_each(ledger.events_by_source_id, source_id=q, user_id=user_id)
                found = [f for f in found if home is None or f.shard == home]
                events = _sharded(merge(found, lambda e: (e.received_at, e.id), PAGE))
            if len(events) == 1:
                return RedirectResponse(
                    f"/events/{events[0].id}{on(getattr(events[0], 'shard', None))}", status_code=303
                )
        tried += ["run id", "event id", "user id", "source id"]
        return self.page(request, "search.html", q=q, kind=kind, events=events, tried=tried, banners=banners)

    async def timeline(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        user_id = request.path_params["user_id"]
        before = ledger.Cursor.decode(request.query_params.get("before"))
        shard = await self.user_shard(user_id) if _storable(user_id) else 0
        data = await self.read_on(shard, ledger.timeline, user_id, before, PAGE) if _storable(user_id) else None
        if data is None or (data.user is None and not data.entries):
            raise Refused(404, "unknown_user", f"the ledger has nothing for user {_shown(user_id)!r}")
        tasks = await self.read_on(shard, ledger.tasks_of_user, user_id) if before is None else []
        return self.page(
            request, "timeline.html", user_id=user_id, tl=data, first=before is None, tasks=tasks, shard=shard
        )

    async def event(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        event_id = _ledger_id(request.path_params["event_id"])
        shard, e, banners = (0, None, []) if event_id is None else await self.find(request, ledger.event, event_id)
        if e is None:
            raise Refused(404, "unknown_event", f"no event {_shown(request.path_params['event_id'])!r}")
        runs = await self.read_on(shard, ledger.runs_of_event, e)
        return self.page(request, "event.html", e=e, runs=runs, shard=shard, banners=banners)

    async def run(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        run_id = _ledger_id(request.path_params["run_id"])
        shard, r, banners = (0, None, []) if run_id is None else await self.find(request, ledger.run, run_id)
        if r is None:
            raise Refused(404, "unknown_run", f"no run {_shown(request.path_params['run_id'])!r}")
        events = await self.read_on(shard, ledger.events_by_id, r.event_ids)
        writes = (await self.read_on(shard, ledger.run_writes, [r]))[r.id]
        # Its journal, when VIGIL_RUN_JOURNAL_DAYS keeps finished ones (docs/worker.md).
        key = f"{r.user_id}:{min(r.event_ids)}" if r.event_ids else None
        steps = await self.read_on(shard, ledger_journal.steps, key) if key else []
        # Its what-if replays (`vigil runs replay`; docs/agent.md, "Changing an agent safely").
        replays = await self.read_on(shard, ledger_replays.of_run, key) if key else []
        return self.page(
            request,
            "run.html",
            r=r,
            events=events,
            w=writes,
            steps=[s.view() for s in steps],
            replays=replays,
            shard=shard,
            banners=banners,
        )

    async def delivery(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        try:
            delivery_id = UUID(request.path_params["delivery_id"])
        except ValueError:
            raise Refused(400, "bad_delivery_id", "a delivery id is a UUID") from None
        shard, rows, banners = await self.find(request, ledger.delivery, delivery_id)
        if not rows:
            raise Refused(404, "unknown_delivery", f"no delivery {delivery_id}")
        return self.page(
            request,
            "delivery.html",
            delivery_id=delivery_id,
            rows=rows,
            done=request.query_params,
            shard=shard,
            banners=banners,
        )

    async def dead(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        if len(self.pools) > 1:
            return await self.dead_of_shards(request)
        ev_before = _keyset(request.query_params.get("events_before"), _ledger_id)
        out_before = _keyset(request.query_params.get("outbox_before"), _ledger_id)
        events = await self.read(ledger.dead_events, ev_before, PAGE)
        outbox = await self.read(ledger.dead_outbox_rows, out_before, PAGE)
        actions = await self.read(ledger.operator_actions) if ev_before is None and out_before is None else []
        return self.page(
            request,
            "dead.html",
            events=events,
            deliveries=_by_delivery(outbox),
            events_next=_cursor(events[-1].finished_at, events[-1].id) if len(events) == PAGE else None,
            outbox_next=_cursor(outbox[-1].dead_at, outbox[-1].id) if len(outbox) == PAGE else None,
            done=request.query_params,
            actions=actions,
        )

    async def dead_of_shards(self, request: Request) -> Response:
        """The dead letters of every shard, merged newest first, each a shard's keyset in the cursor."""
        ev_text, out_text = request.query_params.get("events_before"), request.query_params.get("outbox_before")
        events, events_next, banners = await self.page_each(
            ledger.dead_events, lambda e: (e.finished_at, e.id), (ev_text, 2, _ledger_id)
        )
        outbox, outbox_next, more = await self.page_each(
            ledger.dead_outbox_rows, lambda o: (o.dead_at, o.id), (out_text, 2, _ledger_id)
        )
        first = ev_text is None and out_text is None
        found, gone = await self.read_each(ledger.operator_actions) if first else ([], [])
        actions = [f.value for f in merge(found, lambda a: a.at, 20)]
        return self.page(
            request,
            "dead.html",
            events=events,
            deliveries=_by_delivery(outbox),
            events_next=events_next,
            outbox_next=outbox_next,
            done=request.query_params,
            actions=actions,
            banners=sorted(set(banners + more + gone)),
        )

    async def approvals(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        if len(self.pools) > 1:
            key = lambda a: (a.due, a.request_id)  # noqa: E731
            rows, nxt, banners = await self.page_each(
                ledger.open_approvals, key, (request.query_params.get("after"), 2, str)
            )
            return self.page(request, "approvals.html", rows=rows, next=nxt, banners=banners)
        after = _keyset(request.query_params.get("after"), str)
        rows = await self.read(ledger.open_approvals, after, PAGE)
        nxt = _cursor(rows[-1].due, rows[-1].request_id) if len(rows) == PAGE else None
        return self.page(request, "approvals.html", rows=rows, next=nxt)

    async def timers(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        now = utc(self.clock.now())
        if len(self.pools) > 1:
            key = lambda t: (t.due, t.user_id, t.id)  # noqa: E731
            text = request.query_params.get("after")
            rows, nxt, banners = await self.page_each(ledger.timers_due_before, key, (text, 3, str), now + TIMERS_SOON)
            return self.page(request, "timers.html", rows=rows, next=nxt, soon=TIMERS_SOON, banners=banners)
        after = _keyset(request.query_params.get("after"), str, parts=3)
        rows = await self.read(ledger.timers_due_before, now + TIMERS_SOON, after, PAGE)
        nxt = _cursor(rows[-1].due, rows[-1].user_id, rows[-1].id) if len(rows) == PAGE else None
        return self.page(request, "timers.html", rows=rows, next=nxt, soon=TIMERS_SOON)

    async def partitions(self, request: Request) -> Response:
        """The ledger's rows and the broker's end offsets, asked at once (the broker's answer is
        cached and bounded: see vigil.console.lag). Several shards: each shard's partitions."""
        await self.operator(request, auth.Need.READ)
        topic = self.settings.events_topic
        (found, banners), _ends = await asyncio.gather(self.read_each(ledger.partitions), self.end_offsets.of(topic))
        rows = found[0].value if len(self.pools) == 1 else [Sharded(f.shard, row) for f in found for row in f.value]
        # A Sharded row reads as its PartitionRow, with its shard.
        joined, ends = await self.end_offsets.lags(rows, [topic])  # type: ignore[arg-type]
        now = utc(self.clock.now())
        asked = {t: (answered_at(e, now), e.error) for t, e in ends.items()}
        shard_of = (await self.shard_map()).shard_of if len(self.pools) > 1 else None
        return self.page(request, "partitions.html", rows=joined, asked=asked, shard_of=shard_of, banners=banners)

    # -- actions ---------------------------------------------------------------------------

    async def retry_events(self, request: Request) -> Response:
        """Retry the chosen dead events, each on its shard (a form value ``SHARD:ID`` with
        several shards; the id alone with one)."""
        operator, form = await self.form_action(request)
        chosen = [_shard_and_id(str(v), len(self.pools)) for v in form.getlist("event_id")]
        if None in chosen:
            raise Refused(400, "bad_event_id", f"event ids are whole numbers from 1 to {ledger.MAX_BIGINT}")
        if not chosen or len(set(chosen)) > MAX_RETRY_IDS:
            raise Refused(400, "bad_event_id", f"choose between 1 and {MAX_RETRY_IDS} dead events")
        on: dict[int, set[int]] = {}
        for shard, event_id in chosen:  # type: ignore[misc]  # None refused above
            on.setdefault(shard, set()).add(event_id)
        retried: list[str] = []
        missing: list[str] = []
        for shard, ids in sorted(on.items()):
            result = await self.read_on(shard, retry_dead_events, sorted(ids), operator.actor)
            tag = (lambda i, s=shard: f"{s}:{i}") if len(self.pools) > 1 else str
            retried += map(tag, result.retried)
            missing += map(tag, result.missing)
        ACTIONS.labels("dead.retry").inc()
        log.info("%s retried dead events %s", operator.actor, retried)
        query = urlencode({"retried": ",".join(retried), "missing": ",".join(missing)})
        return RedirectResponse(f"/dead?{query}", status_code=303)

    async def revive(self, request: Request) -> Response:
        """Send a dead delivery again on the shard that holds it (a delivery id is a UUID)."""
        operator, _form = await self.form_action(request)
        try:
            delivery_id = UUID(request.path_params["delivery_id"])
        except ValueError:
            raise Refused(400, "bad_delivery_id", "a delivery id is a UUID") from None
        shard, _rows, _ = await self.find(request, ledger.delivery, delivery_id)
        rows = await self.read_on(shard, revive_delivery, str(delivery_id), operator.actor)
        ACTIONS.labels("delivery.revive").inc()
        log.info("%s revived delivery %s (%d rows)", operator.actor, delivery_id, len(rows))
        outcome = "revived" if rows else "not_dead"
        on = shard_link(len(self.pools))(shard)
        return RedirectResponse(f"/deliveries/{delivery_id}{on}{'&' if on else '?'}{outcome}=1", status_code=303)

    async def stylesheet(self, _request: Request) -> Response:
        return Response((TEMPLATES / "console.css").read_text(), media_type="text/css")


OVERVIEW_ROWS = 10  # ledger.overview's lists: across shards, merged by time (ids count per shard)
# The lists that run forward (nearest deadline first); the others are newest first.
FORWARD = (ledger.open_approvals, ledger.timers_due_before)


def _by_delivery(outbox: list) -> dict[UUID, list]:
    """Dead outbox rows by delivery (one delivery's rows are revived together)."""
    deliveries: dict[UUID, list] = {}
    for row in outbox:
        deliveries.setdefault(row.delivery_id, []).append(row)
    return deliveries


def _shard_and_id(text: str, shards: int) -> tuple[int, int] | None:
    """A retry form's value: ``SHARD:ID`` with several shards, ``ID`` with one."""
    shard, _, event_id = text.rpartition(":") if shards > 1 else ("0", "", text)
    number, at = _ledger_id(event_id), _shard_param(shard, shards - 1)
    return None if number is None or at is None else (at, number)


def _combined(found: list[Found[ledger.Overview]]) -> ledger.Overview:
    """The overview of several shards: counts summed, the oldest waiting thing of any shard,
    the lists merged (each row knowing its shard)."""
    views = [f.value for f in found]
    per_minute: dict[datetime, int] = {}
    for v in views:
        for minute, runs in v.runs_per_minute:
            per_minute[minute] = per_minute.get(minute, 0) + runs
    waiting = [(v.oldest_undelivered, n) for n, v in enumerate(views) if v.oldest_undelivered is not None]
    oldest = views[min(waiting)[1]] if waiting else None
    pending = [Found(f.shard, f.value.oldest_pending_events) for f in found]
    recent = [Found(f.shard, f.value.recent_runs) for f in found]
    return dataclasses.replace(
        views[0],
        pending=min(sum(v.pending for v in views), views[0].cap),
        oldest_pending=min((v.oldest_pending for v in views if v.oldest_pending), default=None),
        runs_per_minute=sorted(per_minute.items()),
        dead_events_last_hour=sum(v.dead_events_last_hour for v in views),
        dead_outbox_rows_last_hour=sum(v.dead_outbox_rows_last_hour for v in views),
        undelivered=sum(v.undelivered for v in views),
        oldest_undelivered=oldest.oldest_undelivered if oldest else None,
        oldest_undelivered_user=oldest.oldest_undelivered_user if oldest else None,
        oldest_undelivered_run=oldest.oldest_undelivered_run if oldest else None,
        # Sharded rows read as the rows they hold, with their shard (the links carry it).
        oldest_pending_events=_sharded(  # type: ignore[arg-type]
            merge(pending, lambda e: (e.received_at, e.id), OVERVIEW_ROWS, newest_first=False)
        ),
        recent_runs=_sharded(merge(recent, lambda r: (r.finished_at, r.id), OVERVIEW_ROWS)),  # type: ignore[arg-type]
        approvals_open=sum(v.approvals_open for v in views),
        approvals_late=sum(v.approvals_late for v in views),
        timers_late=sum(v.timers_late for v in views),
    )


def _frozen(values: list[str] | None) -> frozenset[str] | None:
    return None if values is None else frozenset(values)


def _tuple(values: list[str] | None) -> tuple[str, ...] | None:
    return None if values is None else tuple(values)


def _csrf_refusal() -> Refused:
    return Refused(403, "csrf", "the form's CSRF token is missing or wrong: reload the page and try again")


def _cookie(response: Response, request: Request, name: str, value: str, max_age: int, path: str = "/") -> None:
    """A cookie no script reads (HttpOnly), no other site's page sends (SameSite=Strict), that
    expires (Max-Age), and Secure over HTTPS."""
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path=path,
    )


def _safe_next(target: str | None) -> str:
    """Where to go after logging in: a path on this console only (never //host or a URL)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _ledger_id(text: str) -> int | None:
    """A ledger id in a path or a form: ASCII digits within bigint (vigil.numbers), else None.
    int() would take "²" and fail on 5,000 digits, and the ledger on 20 (500s, issue 46)."""
    try:
        return whole_number(text, 1, ledger.MAX_BIGINT)
    except NotParsed:
        return None


def _storable(*texts: str | None) -> bool:
    """Whether the ledger can hold these texts (PostgreSQL's text holds no NUL): one that it
    cannot is a value nothing in the ledger has."""
    return not any(t and "\x00" in t for t in texts)


def _shown(text: str) -> str:
    """What a refusal echoes of a client's id: a bounded prefix."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _pieces(t: datetime, *rest: int | str) -> list[str]:
    """A keyset as a cursor writes it: the time at full precision (a rounded one would skip the
    rows between it and the real one), ids of any text, every piece a string."""
    return [t.isoformat(), *map(str, rest)]


def _cursor(t: datetime, *rest: int | str) -> str:
    """A list page's keyset for its "next" link, as JSON (see _pieces)."""
    return json.dumps(_pieces(t, *rest), separators=(",", ":"))


def _keyset(text: str | None, last: Callable[[str], Any], parts: int = 2) -> tuple | None:
    """The keyset a "next" link carries (see _cursor); None (the first page) if malformed:
    its pieces are text, as _cursor writes them, none with a NUL."""
    if not text:
        return None
    try:
        return _keyset_of(json.loads(text), last, parts)
    except ValueError:
        return None


def _keyset_of(pieces: Any, last: Callable[[str], Any], parts: int) -> tuple | None:
    try:
        if not isinstance(pieces, list) or len(pieces) != parts or not all(isinstance(p, str) for p in pieces):
            return None
        if not _storable(*pieces) or (key := last(pieces[-1])) is None:
            return None
        return (datetime.fromisoformat(pieces[0]), *pieces[1:-1], key)
    except (ValueError, TypeError, OverflowError):
        return None


def _keysets(text: str | None, shards: int, last: Callable[[str], Any], parts: int) -> list[tuple | None]:
    """A several-shard "next" link's keysets, one per shard (None: that shard from its start);
    malformed: every shard from its start."""
    try:
        each = json.loads(text) if text else None
    except ValueError:
        each = None
    if not isinstance(each, list) or len(each) != shards:
        return [None] * shards
    return [None if k is None else _keyset_of(k, last, parts) for k in each]


def _shard_param(text: str | None, top: int) -> int | None:
    """``?shard=N`` of an id's page, or None when absent or not one of the shards."""
    try:
        return whole_number(text, 0, top) if text else None
    except NotParsed:
        return None


def create_app(settings: ConsoleSettings) -> Starlette:
    console = Console(settings)
    database = dependency_checks(settings)["database"]
    routes = [
        Route("/", console.overview),
        Route("/login", console.login_form, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/search", console.search),
        Route("/users/{user_id:path}", console.timeline),
        # Ids as text, read after authentication (_ledger_id): int() in the route ran before it.
        Route("/events/{event_id}", console.event),
        Route("/runs/{run_id}", console.run),
        Route("/deliveries/{delivery_id}", console.delivery, methods=["GET"]),
        Route("/deliveries/{delivery_id}/revive", console.revive, methods=["POST"]),
        Route("/dead", console.dead),
        Route("/dead/events/retry", console.retry_events, methods=["POST"]),
        Route("/approvals", console.approvals),
        Route("/timers", console.timers),
        Route("/partitions", console.partitions),
        Route("/static/console.css", console.stylesheet),
        # The console needs the ledger only: Kafka being down is not its problem.
        *health_routes(Readiness({"database": database})),
    ]

    async def refused(request: Request, exc: Refused) -> Response:
        signed_out = exc.status == 401 or exc.code == "token_revoked"
        if signed_out and request.method == "GET" and "text/html" in request.headers.get("accept", ""):
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            response = RedirectResponse(f"/login?{urlencode({'next': target})}", status_code=303)
            response.delete_cookie(auth.COOKIE, path="/")
            return response
        return console.refused(request, exc)

    async def starlette_refused(request: Request, exc: HTTPException) -> Response:
        # No route, no method, a form past its limits: ingest's codes, not "not_found" for all.
        code = HTTP_CODES.get(exc.status_code, "http_error")
        return console.refused(
            request, Refused(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}))
        )

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        for pool in console.pools:
            await run_in_threadpool(pool.open, False)
        log.info("console on http://%s:%d", settings.console_host, settings.console_port)
        try:
            yield
        finally:
            for pool in console.pools:
                await run_in_threadpool(pool.close)

    app = Starlette(
        routes=routes,
        middleware=[Middleware(Metrics), Middleware(HostCheck)],
        exception_handlers={
            Refused: refused,  # type: ignore[dict-item]  # each for its class
            HTTPException: starlette_refused,  # type: ignore[dict-item]
            ClientDisconnect: on_disconnect,
        },
        lifespan=lifespan,
    )
    app.state.console = console
    return app
