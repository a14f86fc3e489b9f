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
from datetime import UTC, datetime
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

# What a client should wait before retrying a 503: long enough for a broker leader election
# or a database failover, short enough that a webhook provider's own retry is not needed.
RETRY_AFTER_S = 5


class Refusal(Exception):
    """A request ingest will not act on. ``detail`` is safe to show the caller and to log."""

    def __init__(self, status: int, code: str, detail: str, *, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def response(self) -> Response:
        return JSONResponse(
            {"error": self.code, "detail": self.detail, **self.extra}, self.status, headers=self.headers
        )


def unavailable(code: str, detail: str, **extra: Any) -> Refusal:
    """503: a dependency did not answer. Nothing was acknowledged; the same request may be retried."""
    return Refusal(503, code, detail, headers={"Retry-After": str(RETRY_AFTER_S)}, **extra)


def invalid(field: str, detail: str, code: str = "invalid_request") -> Refusal:
    return Refusal(400, code, f"{field}: {detail}", field=field)


def received_at(request: Request) -> datetime:
    """When the request arrived (stamped by the middleware before anything else ran)."""
    stamp = request.scope.get("vigil.received_at")
    return stamp if stamp is not None else datetime.now(UTC)


def require_json(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        shown = media[:100] or "none"
        raise Refusal(415, "unsupported_media_type", f"expected Content-Type application/json, got {shown}")
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
        if not declared.isdigit():
            raise Refusal(400, "invalid_request", "Content-Length is not a number")
        if int(declared) > limit:
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


def parse_json(body: bytes) -> Any:
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
        return DECODER.decode(text)
    except ValueError as exc:
        raise Refusal(400, "invalid_json", f"malformed JSON: {exc}") from None
    except RecursionError:
        raise Refusal(400, "invalid_json", "JSON nested too deeply") from None


def _not_json(name: str) -> None:
    # Python's json accepts NaN and Infinity; other consumers of the payload would not.
    raise ValueError(f"{name} is not valid JSON")


# One decoder for every request: json.loads with an option builds a new one per call.
DECODER = json.JSONDecoder(parse_constant=_not_json)


async def read_json(request: Request, limit: int) -> Any:
    """415, 413 and 400 checks in that order, then the parsed document."""
    require_json(request)
    return parse_json(await read_body(request, limit))


# -- exception handlers -----------------------------------------------------------------


async def on_refusal(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refusal)
    if exc.status >= 500:
        log.warning("refused with %d %s: %s", exc.status, exc.code, exc.detail)
    else:
        log.debug("refused with %d %s: %s", exc.status, exc.code, exc.detail)
    return exc.response()


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def on_http_exception(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    return JSONResponse({"error": code, "detail": exc.detail}, exc.status_code, headers=exc.headers)


async def on_unexpected(_: Request, exc: Exception) -> Response:
    # The request was not acknowledged, so a retry is safe; the traceback is for operators.
    log.error("unexpected error", exc_info=exc)
    return JSONResponse({"error": "internal", "detail": "unexpected error; retry later"}, 500)


EXCEPTION_HANDLERS = {Refusal: on_refusal, HTTPException: on_http_exception, Exception: on_unexpected}
