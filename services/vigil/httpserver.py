"""Bounded HTTP/1.1 serving for every vigil port (ingest's API and the health ports).

uvicorn with httptools bounds neither the request head nor the time a client may take to
send it: a 32 MB header is buffered whole by the parser, a half-sent request holds its
connection (and its buffer) forever, and nothing caps the number of open connections. Its
own options do not reach these: ``h11_max_incomplete_event_size`` only applies to the h11
parser, and ``limit_concurrency`` answers 503 only once a head is complete.

:class:`BoundedHttpToolsProtocol` is uvicorn's httptools protocol with those bounds added
at the protocol level, before any ASGI application sees the request:

- the head (request line and headers) is at most ``max_head_bytes`` and ``max_headers``
  headers: 431, counted while it arrives, so at most one socket read past the bound is
  ever buffered;
- the head must arrive within ``head_timeout_s`` of the connection (or of the first byte
  of a later request on a kept-alive connection), the body within ``body_timeout_s`` of the
  head: 408 and the connection closed;
- at most ``max_connections`` connections per process: a connection past the cap gets a
  503 and is closed at once;
- a kept-alive connection idles at most ``keep_alive_s``;
- a request the parser cannot read (an unknown method, a malformed line) gets a JSON 400
  instead of uvicorn's plain-text one.

Every refusal is a :class:`Refusal`, the one HTTP refusal type of every vigil server, with
its one body shape, ``{"error": code, "detail": ...}``, and closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import uvicorn
from prometheus_client import Counter
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from vigil.errors import VigilError

log = logging.getLogger(__name__)

REFUSED = Counter(
    "vigil_http_refused_total",
    "Requests or connections refused by the HTTP server before the application saw them, by reason.",
    ["reason"],  # head_too_large | too_many_headers | head_timeout | body_timeout | too_many_connections | malformed
)


@dataclass(frozen=True)
class ServerLimits:
    """The bounds of one HTTP server. Defaults fit an API whose heads are a few hundred bytes."""

    # Browsers and proxies send heads of a few KiB; nginx's default buffers are 8 KiB.
    max_head_bytes: int = 16 * 1024
    max_headers: int = 100
    # A real client sends its head in one packet; ten seconds covers a slow mobile link.
    head_timeout_s: float = 10.0
    # 1 MiB over a slow link; a body that takes longer is a slow-loris, not a client.
    body_timeout_s: float = 30.0
    max_connections: int = 1000
    keep_alive_s: int = 5


# After a refusal, how long the client's further bytes are read and dropped before the
# socket closes (see BoundedHttpToolsProtocol._linger).
LINGER_S = 1.0

# A 429 whose raiser named no wait says this one: a client told nothing retries at once.
DEFAULT_RETRY_AFTER_S = 1

# The health and metrics ports: probes and scrapes only.
HEALTH_LIMITS = ServerLimits(max_head_bytes=8 * 1024, max_headers=50, body_timeout_s=10.0, max_connections=100)


class Refusal(VigilError):
    """A request vigil will not act on: the one HTTP refusal every server raises.

    Ingest (and the timers API it serves), the console, the approval answers and this
    module's connection limits all refuse with it, and all answer with one body,
    ``{"error": code, "detail": detail}`` plus any ``extra`` fields (ingest's ``field``,
    ``reason``...). ``detail`` is safe to show the caller and to log. ``counted_as`` is the
    label of the connection-level refusal counter (``vigil_http_refused_total``); it
    defaults to ``code``. Every 429 carries ``Retry-After`` (``DEFAULT_RETRY_AFTER_S`` unless
    the raiser gave one).
    """

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        counted_as: str | None = None,
        **extra: Any,
    ):
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}
        if status == 429 and not any(name.lower() == "retry-after" for name in self.headers):
            self.headers = {**self.headers, "Retry-After": str(DEFAULT_RETRY_AFTER_S)}
        self.counted_as = counted_as or code
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "detail": self.detail, **self.extra}

    def response(self) -> Response:
        return JSONResponse(self.body(), self.status, headers=self.headers)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of :class:`ServerLimits` (see the module)."""

    limits: ClassVar[ServerLimits] = ServerLimits()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._refused = False
        self._read_timer: asyncio.TimerHandle | None = None

    # -- the connection ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(
                Refusal(503, "overloaded", "too many open connections; retry later", counted_as="too_many_connections"),
                retry_after=1,
            )
            return
        self._arm(self.limits.head_timeout_s, "head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(Refusal(400, "invalid_request", "protocol upgrades are not supported", counted_as="malformed"))
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, Refusal):
                self._refuse(cause)
            else:
                self._refuse(Refusal(400, "invalid_request", "malformed HTTP request", counted_as="malformed"))
            return
        if self._in_head:
            # The whole read belongs to an unfinished head: count it before the next read
            # is buffered. (A head completed in this read was counted exactly by on_header.)
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_head_bytes:
                self._refuse(self._head_too_large())

    # -- parser callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_timer is None:  # a later request on a kept-alive connection
            self._arm(self.limits.head_timeout_s, "head")
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            raise Refusal(
                431,
                "headers_too_large",
                f"more than {self.limits.max_headers} header fields",
                counted_as="too_many_headers",
            )
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout_s, "body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # -- refusals ---------------------------------------------------------------------

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.limits.max_head_bytes:
            raise self._head_too_large()

    def _head_too_large(self) -> Refusal:
        return Refusal(
            431,
            "headers_too_large",
            f"the request line and headers are larger than {self.limits.max_head_bytes} bytes",
            counted_as="head_too_large",
        )

    def _arm(self, seconds: float, phase: str) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._timed_out, phase, seconds)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self, phase: str, seconds: float) -> None:
        self._read_timer = None
        detail = f"the request {phase} did not arrive within {seconds:g}s"
        self._refuse(Refusal(408, "request_timeout", detail, counted_as=f"{phase}_timeout"))

    def _refuse(self, refusal: Refusal, retry_after: int | None = None) -> None:
        """Answer ``refusal`` and close; every later byte from the client is discarded.

        An earlier request of the same connection whose answer is still being prepared
        (pipelining) keeps its answer: it may already have been acted on. The connection
        just closes after it. A request whose body was still arriving (a body timeout) gets
        the refusal, and its application sees a disconnect.
        """
        self._refused = True
        self._disarm()
        REFUSED.labels(refusal.counted_as).inc()
        log.debug("refused a connection: %d %s", refusal.status, refusal.detail)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        running = cycle is not None and not cycle.response_complete
        if running and not cycle.more_body:
            cycle.keep_alive = False  # uvicorn closes the connection after this answer
            return
        if not running or not cycle.response_started:  # a finished cycle is an earlier request's
            body = json.dumps(refusal.body()).encode()
            head = [
                STATUS_LINE[refusal.status],
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n",
            ]
            if retry_after is not None:
                head.append(b"retry-after: %d\r\n" % retry_after)
            self.transport.write(b"".join(head) + b"\r\n" + body)
        if running:
            # Its application's reads end and its writes go nowhere (uvicorn's own
            # disconnect handling, done now rather than when the socket is gone).
            cycle.disconnected = True
            cycle.message_event.set()
        self._linger()

    def _linger(self) -> None:
        """Send FIN after the answer and discard what the client still sends for a moment.

        Closing at once, with the client's unread bytes (the rest of a huge head, a body)
        in the socket, makes the kernel send RST, and an RST can destroy the answer before
        the client reads it. The wait is bounded, and nothing is buffered meanwhile.
        """
        try:
            self.transport.resume_reading()
            if self.transport.can_write_eof():
                self.transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self.transport.close()
            return
        self.loop.call_later(LINGER_S, self.transport.close)


# -- the application's own refusals, in the same shape -------------------------------------

# Starlette's own refusals: no route, no method, and a form past its limits (the console's
# login and action forms: too many fields, a part too large).
HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


async def on_http_exception(_: Request, exc: Exception) -> Response:
    """Starlette's own 404 and 405 (no route, no method) in the one refusal shape, not plain text."""
    assert isinstance(exc, HTTPException)
    code = HTTP_CODES.get(exc.status_code, "http_error")
    return JSONResponse({"error": code, "detail": exc.detail}, exc.status_code, headers=exc.headers)


async def on_disconnect(_: Request, exc: Exception) -> Response:
    """The client went away (or this module's body timeout answered 408 and closed it) while
    its body was read: nothing was done, nobody is left to read an answer, and it is neither
    a traceback nor a 500 (issue 58: the console's login logged one and counted a 500)."""
    log.debug("client disconnected before its body was read")
    return JSONResponse({"error": "client_disconnected", "detail": "the request body was not received"}, 400)


def host_problem(scope: dict) -> Refusal | None:
    """RFC 9112 section 3.2: an HTTP/1.1 request without ``Host``, or any request with more
    than one, is a 400 (two could name two different sites to a proxy in front)."""
    hosts = sum(1 for name, _ in scope.get("headers", ()) if name.lower() == b"host")
    if hosts > 1:
        return Refusal(400, "invalid_request", "Host: sent more than once", field="Host")
    if hosts == 0 and scope.get("http_version") != "1.0":
        return Refusal(400, "invalid_request", "Host: is missing (HTTP/1.1 requires it)", field="Host")
    return None


class HostCheck:
    """Pure ASGI middleware: :func:`host_problem`'s rule on every port vigil serves (the
    console, each service's health and metrics port; ingest applies it in its own target
    check), the same 400 JSON everywhere."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        problem = host_problem(scope) if scope["type"] == "http" else None
        if problem is not None:
            await problem.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def on_unexpected(_: Request, exc: Exception) -> Response:
    # The request was not acknowledged, so a retry is safe; the traceback is for operators.
    log.error("unexpected error", exc_info=exc, extra={"event": "request_failed"})
    return JSONResponse({"error": "internal", "detail": "unexpected error; retry later"}, 500)


def bounded_protocol(limits: ServerLimits) -> type[BoundedHttpToolsProtocol]:
    """A protocol class carrying ``limits`` (uvicorn builds one instance per connection)."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})


def server_config(app: Any, host: str, port: int, limits: ServerLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config serving ``app`` within ``limits``; access log off, no Server header."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=bounded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_s,
        # Also bounds the head if anyone switches to h11.
        h11_max_incomplete_event_size=limits.max_head_bytes,
        access_log=False,
        server_header=False,
        **options,
    )
