"""What every ingest endpoint does with a request before its own logic: refuse precisely.

Every refusal is a :class:`Refusal`, rendered as ``{"error": code, "detail": ...}`` with its
status; nothing has been produced or stored when one is raised. Bodies are read through
:func:`read_body`, which enforces the size bound before the body is in memory: a declared
``Content-Length`` over the bound is refused without reading a byte of it, and a chunked
body is refused as soon as the running total passes the bound.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from vigil.httpserver import Refusal as Refusal  # the one refusal type; ingest's modules import it from here
from vigil.httpserver import host_problem, on_disconnect, on_http_exception, on_unexpected
from vigil.numbers import MAX_DIGITS, NotParsed, json_constant, json_float, json_int, whole_number

log = logging.getLogger(__name__)

# What a client should wait before retrying a 503: long enough for a broker leader election
# or a database failover, short enough that a webhook provider's own retry is not needed.
RETRY_AFTER_S = 5


def unavailable(code: str, detail: str, **extra: Any) -> Refusal:
    """503: a dependency did not answer. Nothing was acknowledged; the same request may be retried."""
    return Refusal(503, code, detail, headers={"Retry-After": str(RETRY_AFTER_S)}, **extra)


def invalid(field: str, detail: str, code: str = "invalid_request") -> Refusal:
    return Refusal(400, code, f"{field}: {detail}", field=field)


def header_text(request: Request, name: str, field: str | None = None) -> str | None:
    """A header's value as the text the client sent, or None when it is absent.

    Header bytes arrive decoded as latin-1 (so ``café`` sent as UTF-8 reads ``cafÃ©``); they
    are decoded as UTF-8 here, and a value that is not UTF-8 is a 400 naming ``field`` (the
    header's name by default). ``Idempotency-Key`` has its own, narrower rule: printable ASCII.
    """
    value = request.headers.get(name)
    if value is None or value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(field or name, "is not UTF-8 text") from None


def received_at(request: Request) -> datetime:
    """When the request arrived (stamped by the middleware before anything else ran)."""
    stamp = request.scope.get("vigil.received_at")
    return stamp if stamp is not None else datetime.now(UTC)


def require_json(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        shown = media[:100] or "none"
        hint = ""
        if media == "application/x-www-form-urlencoded":
            # GitHub's default for a new webhook: the fix is a setting on GitHub's side.
            hint = " (a GitHub webhook: set its Content type to application/json)"
        raise Refusal(415, "unsupported_media_type", f"expected Content-Type application/json, got {shown}{hint}")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        # A compressed body would only fail later as malformed JSON; say what is wrong.
        raise Refusal(
            415,
            "unsupported_media_type",
            f"Content-Encoding {encoding[:40]} is not supported; send the body uncompressed",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes; 413 as soon as it is known to be larger."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = whole_number(declared, 0, 10**MAX_DIGITS - 1)
        except NotParsed:
            raise invalid("Content-Length", "is not a whole number of bytes") from None
        if size > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int) -> Refusal:
    # Connection: close, because the unread rest of the body is still on the socket.
    return Refusal(413, "body_too_large", f"request body is larger than {limit} bytes", headers={"Connection": "close"})


def parse_json(body: bytes, code: str = "invalid_json") -> Any:
    """The document; 400 ``invalid_json`` if it is not JSON, 400 ``code`` if a string in it
    breaks the text rule (see :func:`check_document`)."""
    if not body.strip():
        raise Refusal(400, "invalid_json", "the body is empty; expected a JSON document")
    try:
        # Decoded strictly first: json.loads would also guess UTF-16 and UTF-32, and the
        # payload travels on as UTF-8 text.
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(400, "invalid_json", "the body is not UTF-8") from None
    try:
        if text.startswith("\ufeff"):
            return json.loads(text)  # raises json.loads's own error for a byte order mark
        document = DECODER.decode(text)
    except NotParsed as exc:  # a number the decoder's hooks refused, in their words
        raise invalid("body", str(exc), "invalid_json") from None
    except json.JSONDecodeError as exc:
        raise invalid("body", f"malformed JSON: {exc}", "invalid_json") from None
    except ValueError:  # a conversion Python itself refused: its words are not for clients
        raise invalid("body", "a value in it cannot be read", "invalid_json") from None
    except RecursionError:
        raise invalid("body", "JSON nested too deeply", "invalid_json") from None
    if "\\u" in text:
        # A lone surrogate or a NUL can only arrive as a \u escape (the text itself is strict
        # UTF-8, and raw control characters are not JSON), so only such bodies are walked.
        check_document(document, code)
    return document


# One decoder for every request (json.loads with an option builds a new one per call). Its
# number hooks are vigil.numbers': bounded literals, finite, no silent 0 for 1e-400, no NaN.
DECODER = json.JSONDecoder(parse_constant=json_constant, parse_float=json_float, parse_int=json_int)


# -- the one rule for text ---------------------------------------------------------------


def text_problem(value: str, *, ident: bool = False) -> str | None:
    """Why ``value`` cannot be stored as text, or None.

    Every text field: valid Unicode scalar values (no lone surrogate: it has no UTF-8
    encoding, so Kafka, the codec and PostgreSQL all refuse it later) and no NUL
    (PostgreSQL text and jsonb cannot hold one). Ids (``ident``: user ids, sources, keys,
    anything used in a URL, a Kafka key or an operator's terminal) also have no control
    or other non-printable characters.
    """
    if "\x00" in value:
        return "must not contain NUL"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (a lone surrogate is not)"
    if ident and not value.isprintable():
        return "must not contain control characters"
    return None


def check_text(value: str, field: str, *, ident: bool = False) -> str:
    """``value``, or a 400 naming ``field`` (see :func:`text_problem`)."""
    problem = text_problem(value, ident=ident)
    if problem is not None:
        raise invalid(field, problem)
    return value


def check_document(document: Any, code: str = "invalid_json") -> None:
    """Every key and string of a parsed JSON document passes :func:`text_problem`; else a
    400 whose ``field`` is the path to it (``events[1].payload.note``; ``body`` for the root)."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                raise invalid(where or "body", problem, code)
        elif isinstance(value, dict):
            for key, item in value.items():
                problem = text_problem(key)
                if problem is not None:
                    raise invalid(where or "body", f"a key {problem}", code)
                stack.append((item, f"{where}.{key[:64]}" if where else key[:64]))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{index}]") for index, item in enumerate(value))


async def read_json(request: Request, limit: int, code: str = "invalid_json") -> Any:
    """415, 413 and 400 checks in that order, then the parsed document."""
    require_json(request)
    return parse_json(await read_body(request, limit), code)


# -- exception handlers -----------------------------------------------------------------


async def on_refusal(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refusal)
    if exc.status >= 500:
        log.warning("refused with %d %s: %s", exc.status, exc.code, exc.detail)
    else:
        log.debug("refused with %d %s: %s", exc.status, exc.code, exc.detail)
    return exc.response()


EXCEPTION_HANDLERS = {
    Refusal: on_refusal,
    HTTPException: on_http_exception,
    ClientDisconnect: on_disconnect,
    Exception: on_unexpected,
}


# -- the path and query rule, before any route ------------------------------------------


class SegmentConvertor(Convertor[str]):
    """``{name:segment}``: one path segment, percent-decoded exactly once.

    The one rule for ids in ingest's paths (every path parameter uses it; a test walks the
    route table): an id containing ``/`` (``team-a/bob``, the shape of the token patterns
    ``team-a/*``) is sent as ``team-a%2Fbob``, a ``%`` as ``%25``. :class:`TargetCheck` hands
    the router the path with exactly those two escapes kept, so a segment never splits.
    """

    regex = "[^/]+"

    def convert(self, value: str) -> str:
        return value.replace("%2F", "/").replace("%25", "%")

    def to_string(self, value: str) -> str:
        return value.replace("%", "%25").replace("/", "%2F")


register_url_convertor("segment", SegmentConvertor())


def route(path: str, endpoint: Any, methods: list[str]) -> Route:
    """A route of ingest: every ``{name}`` in ``path`` (the OpenAPI template) is a ``segment``."""
    return Route(re.sub(r"\{(\w+)\}", r"{\1:segment}", path), endpoint, methods=methods)


def _decoded(raw: bytes, name: str) -> str:
    """``raw`` percent-decoded once as UTF-8 and printable, or a 400 naming ``name``."""
    try:
        text = unquote_to_bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(name, "percent-escapes do not decode as UTF-8") from None
    if not text.isprintable():
        raise invalid(name, "must not contain control characters (a %00, a newline)")
    return text


def routing_path(scope: dict) -> str:
    """The path the router matches: the client's path, each segment decoded once.

    uvicorn decodes percent-escapes leniently (invalid UTF-8 becomes U+FFFD, so two raw ids
    would name one user), passes a ``%00`` through to PostgreSQL, and turns ``%2F`` into a
    separator: the path is read again here from the bytes the client sent, segment by
    segment (400 naming ``path`` for the first two), and a ``/`` or ``%`` inside a segment
    stays escaped for :class:`SegmentConvertor` to decode.
    """
    raw_path = scope.get("raw_path") or scope["path"].encode()
    segments = (_decoded(raw, "path") for raw in raw_path.split(b"/"))
    return "/".join(segment.replace("%", "%25").replace("/", "%2F") for segment in segments)


class TargetCheck:
    """Pure ASGI middleware, before routing: the ``Host`` header (:func:`host_problem`), the
    path as :func:`routing_path` reads it, and the query string under the same text rule (a
    400 naming ``Host``, ``path`` or ``query``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            try:
                host = host_problem(scope)
                if host is not None:
                    raise host
                path = routing_path(scope)
                query = scope.get("query_string", b"").replace(b"+", b" ")
                if query:
                    _decoded(query, "query")
            except Refusal as refusal:
                await refusal.response()(scope, receive, send)
                return
            # In place, not a copy: the router records the matched route in this scope, and
            # the metrics and the server span (outer middleware) read it from there.
            scope["path"] = path
        await self.app(scope, receive, send)
