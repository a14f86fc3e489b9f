"""The console's ASGI application: pages, the login, the two retry actions.

Pages are rendered on the server by Jinja2 with autoescaping on for every template, so
whatever a payload, an error or a user id contains is shown as text. The responses also
carry a Content-Security-Policy that allows no script at all: the console needs none, and a
missed escape would still run nothing. Ledger reads go through :mod:`vigil.ledger.console`
only, on worker threads (psycopg's blocking calls stay off the event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from vigil.clock import Clock, SystemClock, utc
from vigil.console import auth
from vigil.console.lag import EndOffsets, answered_at
from vigil.console.settings import ConsoleSettings
from vigil.dispatcher.operator import revive_delivery
from vigil.health import Readiness, dependency_checks, health_routes
from vigil.httpserver import Refusal as Refused  # the one refusal type, under the console's name
from vigil.ledger import console as ledger
from vigil.ledger import ingest as tokens
from vigil.ledger import journal as ledger_journal
from vigil.ledger.db import PoolTimeout
from vigil.ledger.events import retry_dead_events
from vigil.ttl_cache import TtlCache

log = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parent / "templates"
PAGE = 50  # rows per page of every list
TIMERS_SOON = timedelta(minutes=15)  # "due soon" on the timers page
MAX_RETRY_IDS = 100  # one form post retries at most this many events
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


def environment() -> Environment:
    # Autoescape every template whatever its extension: nothing here is meant to emit raw HTML.
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True))
    env.filters.update(ago=_ago, when=_when, pretty=_pretty, redact=_redact, q=lambda v: quote(str(v), safe=""))
    return env


class Console:
    def __init__(self, settings: ConsoleSettings, clock: Clock | None = None):
        self.settings = settings
        self.clock = clock or SystemClock()
        self.pool = ledger.open_pool(settings.dsn)
        self.env = environment()
        self.tokens: TtlCache[tokens.AuthToken] = TtlCache(settings.console_auth_cache_s)
        self.end_offsets = EndOffsets(settings)

    # -- plumbing --------------------------------------------------------------------------

    async def read(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run one ledger function on a pooled connection, off the event loop."""

        def call():
            with self.pool.connection() as conn:
                return fn(conn, *args, **kwargs)

        try:
            return await run_in_threadpool(call)
        except PoolTimeout:
            raise Refused(503, "ledger_unavailable", "no ledger connection available in time") from None
        except psycopg.OperationalError as exc:
            log.warning("ledger unreachable: %s", type(exc).__name__)
            raise Refused(503, "ledger_unavailable", "the ledger did not answer") from None

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

    async def operator(self, request: Request, need: auth.Need) -> auth.Operator:
        """The authenticated operator, or Refused (401/403). Sets it on the request for templates."""
        header = request.headers.get("authorization")
        token = auth.presented_token(header, request.cookies.get(auth.COOKIE))
        if token is None:
            raise Refused(401, "unauthorized", "log in with an API token (vigil tokens create NAME)")
        digest = auth.digest(token)
        row = None if digest is None else await self.tokens.get(digest, lambda: self.read(tokens.auth_token, digest))
        if row is None:
            raise Refused(401, "unauthorized", "unknown token")
        if row.revoked_at is not None:
            raise Refused(403, "token_revoked", f"token {row.id} was revoked")
        scopes, users = row.scopes, row.users
        operator = auth.Operator(
            row.id,
            row.name,
            auth.csrf_for(token),
            None if scopes is None else frozenset(scopes),
            None if users is None else tuple(users),
        )
        if not auth.permits(operator, need):
            raise Refused(403, "forbidden", f"token {row.id} may not {need.value} here")
        request.scope["vigil.operator"] = operator
        request.scope["vigil.via_cookie"] = not (header and header.lower().startswith("bearer "))
        return operator

    async def form_action(self, request: Request) -> tuple[auth.Operator, Any]:
        """A POST: a WRITE operator, and for a browser session the CSRF value back."""
        operator = await self.operator(request, auth.Need.WRITE)
        form = await request.form()
        if request.scope["vigil.via_cookie"] and not auth.csrf_ok(operator, form.get(auth.CSRF_FIELD)):
            raise Refused(403, "csrf", "the form's CSRF token is missing or wrong: reload the page and try again")
        return operator, form

    # -- login -----------------------------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        return self.page(request, "login.html", next=_safe_next(request.query_params.get("next")), failed=None)

    async def login(self, request: Request) -> Response:
        form = await request.form()
        token = str(form.get("token", "")).strip()
        target = _safe_next(str(form.get("next", "/")))
        digest = auth.digest(token) if token else None
        row = None if digest is None else await self.read(tokens.auth_token, digest)
        if row is None or row.revoked_at is not None:
            failed = "That token is not valid." if row is None else "That token was revoked."
            return self.page(request, "login.html", 401, next=target, failed=failed)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            auth.COOKIE,
            token,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        return response

    async def logout(self, request: Request) -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(auth.COOKIE, path="/", httponly=True, samesite="strict")
        return response

    # -- pages -----------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        data = await self.read(ledger.overview, now=utc(self.clock.now()))
        return self.page(request, "overview.html", o=data)

    async def search(self, request: Request) -> Response:
        """One box: a run id, a delivery id, a user id or a source id; the first that exists wins."""
        await self.operator(request, auth.Need.READ)
        q = request.query_params.get("q", "").strip()[:500]
        kind = request.query_params.get("kind", "any")
        if not q:
            return self.page(request, "search.html", q=q, kind=kind, events=[], tried=[])
        tried = []
        if kind in ("any", "run") and q.isdigit() and await self.read(ledger.run, int(q)):
            return RedirectResponse(f"/runs/{q}", status_code=303)
        if kind in ("any", "event") and q.isdigit() and await self.read(ledger.event, int(q)):
            return RedirectResponse(f"/events/{q}", status_code=303)
        if kind in ("any", "delivery"):
            with contextlib.suppress(ValueError):
                if await self.read(ledger.delivery, UUID(q)):
                    return RedirectResponse(f"/deliveries/{UUID(q)}", status_code=303)
            tried.append("delivery id")
        if kind in ("any", "user") and await self.read(ledger.user, q):
            return RedirectResponse(f"/users/{quote(q, safe='')}", status_code=303)
        events: list = []
        if kind in ("any", "source_id"):
            user_id = request.query_params.get("user") or None
            events = await self.read(ledger.events_by_source_id, source_id=q, user_id=user_id)
            if len(events) == 1:
                return RedirectResponse(f"/events/{events[0].id}", status_code=303)
        tried += ["run id", "event id", "user id", "source id"]
        return self.page(request, "search.html", q=q, kind=kind, events=events, tried=tried)

    async def timeline(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        user_id = request.path_params["user_id"]
        before = ledger.Cursor.decode(request.query_params.get("before"))
        data = await self.read(ledger.timeline, user_id, before, PAGE)
        if data.user is None and not data.entries:
            raise Refused(404, "unknown_user", f"the ledger has nothing for user {user_id!r}")
        tasks = await self.read(ledger.tasks_of_user, user_id) if before is None else []
        return self.page(request, "timeline.html", user_id=user_id, tl=data, first=before is None, tasks=tasks)

    async def event(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        e = await self.read(ledger.event, request.path_params["event_id"])
        if e is None:
            raise Refused(404, "unknown_event", f"no event {request.path_params['event_id']}")
        runs = await self.read(ledger.runs_of_event, e)
        return self.page(request, "event.html", e=e, runs=runs)

    async def run(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        r = await self.read(ledger.run, request.path_params["run_id"])
        if r is None:
            raise Refused(404, "unknown_run", f"no run {request.path_params['run_id']}")
        events = await self.read(ledger.events_by_id, r.event_ids)
        writes = (await self.read(ledger.run_writes, [r]))[r.id]
        # Its journal, when VIGIL_RUN_JOURNAL_DAYS keeps finished ones (docs/worker.md).
        steps = await self.read(ledger_journal.steps, f"{r.user_id}:{min(r.event_ids)}") if r.event_ids else []
        return self.page(request, "run.html", r=r, events=events, w=writes, steps=[s.view() for s in steps])

    async def delivery(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        try:
            delivery_id = UUID(request.path_params["delivery_id"])
        except ValueError:
            raise Refused(400, "bad_delivery_id", "a delivery id is a UUID") from None
        rows = await self.read(ledger.delivery, delivery_id)
        if not rows:
            raise Refused(404, "unknown_delivery", f"no delivery {delivery_id}")
        return self.page(request, "delivery.html", delivery_id=delivery_id, rows=rows, done=request.query_params)

    async def dead(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        ev_before = _keyset(request.query_params.get("events_before"), int)
        out_before = _keyset(request.query_params.get("outbox_before"), int)
        events = await self.read(ledger.dead_events, ev_before, PAGE)
        outbox = await self.read(ledger.dead_outbox_rows, out_before, PAGE)
        actions = await self.read(ledger.operator_actions) if ev_before is None and out_before is None else []
        deliveries: dict[UUID, list] = {}
        for row in outbox:
            deliveries.setdefault(row.delivery_id, []).append(row)
        return self.page(
            request,
            "dead.html",
            events=events,
            deliveries=deliveries,
            events_next=_cursor(events[-1].finished_at, events[-1].id) if len(events) == PAGE else None,
            outbox_next=_cursor(outbox[-1].dead_at, outbox[-1].id) if len(outbox) == PAGE else None,
            done=request.query_params,
            actions=actions,
        )

    async def approvals(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        after = _keyset(request.query_params.get("after"), str)
        rows = await self.read(ledger.open_approvals, after, PAGE)
        nxt = _cursor(rows[-1].due, rows[-1].request_id) if len(rows) == PAGE else None
        return self.page(request, "approvals.html", rows=rows, next=nxt)

    async def timers(self, request: Request) -> Response:
        await self.operator(request, auth.Need.READ)
        after = _keyset(request.query_params.get("after"), str, parts=3)
        now = utc(self.clock.now())
        rows = await self.read(ledger.timers_due_before, now + TIMERS_SOON, after, PAGE)
        nxt = _cursor(rows[-1].due, rows[-1].user_id, rows[-1].id) if len(rows) == PAGE else None
        return self.page(request, "timers.html", rows=rows, next=nxt, soon=TIMERS_SOON)

    async def partitions(self, request: Request) -> Response:
        """The ledger's rows and the broker's end offsets, asked at once (the broker's answer is
        cached and bounded: see vigil.console.lag)."""
        await self.operator(request, auth.Need.READ)
        topic = self.settings.events_topic
        rows, _ends = await asyncio.gather(self.read(ledger.partitions), self.end_offsets.of(topic))
        joined, ends = await self.end_offsets.lags(rows, [topic])
        now = utc(self.clock.now())
        asked = {t: (answered_at(e, now), e.error) for t, e in ends.items()}
        return self.page(request, "partitions.html", rows=joined, asked=asked)

    # -- actions ---------------------------------------------------------------------------

    async def retry_events(self, request: Request) -> Response:
        operator, form = await self.form_action(request)
        try:
            ids = sorted({int(v) for v in form.getlist("event_id")})
        except ValueError:
            raise Refused(400, "bad_event_id", "event ids are whole numbers") from None
        if not ids or len(ids) > MAX_RETRY_IDS:
            raise Refused(400, "bad_event_id", f"choose between 1 and {MAX_RETRY_IDS} dead events")
        result = await self.read(retry_dead_events, ids, operator.actor)
        ACTIONS.labels("dead.retry").inc()
        log.info("%s retried dead events %s", operator.actor, result.retried)
        retried, missing = ",".join(map(str, result.retried)), ",".join(map(str, result.missing))
        query = urlencode({"retried": retried, "missing": missing})
        return RedirectResponse(f"/dead?{query}", status_code=303)

    async def revive(self, request: Request) -> Response:
        operator, _form = await self.form_action(request)
        try:
            delivery_id = UUID(request.path_params["delivery_id"])
        except ValueError:
            raise Refused(400, "bad_delivery_id", "a delivery id is a UUID") from None
        rows = await self.read(revive_delivery, str(delivery_id), operator.actor)
        ACTIONS.labels("delivery.revive").inc()
        log.info("%s revived delivery %s (%d rows)", operator.actor, delivery_id, len(rows))
        outcome = "revived" if rows else "not_dead"
        return RedirectResponse(f"/deliveries/{delivery_id}?{outcome}=1", status_code=303)

    async def stylesheet(self, _request: Request) -> Response:
        return Response((TEMPLATES / "console.css").read_text(), media_type="text/css")


def _safe_next(target: str | None) -> str:
    """Where to go after logging in: a path on this console only (never //host or a URL)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _cursor(t: datetime, *rest: int | str) -> str:
    """A list page's keyset for its "next" link: JSON, the time at full precision (a rounded
    one would skip the rows between it and the real one), ids of any text."""
    return json.dumps([t.isoformat(), *rest], separators=(",", ":"))


def _keyset(text: str | None, last: type, parts: int = 2) -> tuple | None:
    """The keyset a "next" link carries (see _cursor); None (the first page) if malformed."""
    if not text:
        return None
    try:
        pieces = json.loads(text)
        if not isinstance(pieces, list) or len(pieces) != parts or not all(isinstance(p, str) for p in pieces[:-1]):
            return None
        return (datetime.fromisoformat(pieces[0]), *pieces[1:-1], last(pieces[-1]))
    except (ValueError, TypeError):
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
        Route("/events/{event_id:int}", console.event),
        Route("/runs/{run_id:int}", console.run),
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

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return console.refused(request, Refused(exc.status_code, "not_found", str(exc.detail)))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette):
        await run_in_threadpool(console.pool.open, False)
        log.info("console on http://%s:%d", settings.console_host, settings.console_port)
        try:
            yield
        finally:
            await run_in_threadpool(console.pool.close)

    app = Starlette(
        routes=routes,
        middleware=[Middleware(Metrics)],
        exception_handlers={Refused: refused, HTTPException: not_found},  # type: ignore[dict-item]  # each for its class
        lifespan=lifespan,
    )
    app.state.console = console
    return app
