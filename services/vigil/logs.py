"""Logging for every vigil process: one JSON object per line (or text for a terminal).

Fields of a JSON line: ``ts``, ``level``, ``service``, ``logger``, ``msg``, then whichever of
``event`` (the line's stable name, see :data:`FIELDS`), ``user_id``, ``event_id``, ``run_id``,
``partition``, ``epoch``, ``trace_id`` the line knows, and ``exc`` (the whole traceback as one
string) for an exception. A line knows a field when
the call passes it (``log.info("...", extra={"partition": 3})``) or when the code around it
set it with :func:`context` (a contextvar: an asyncio task, such as one run, carries its own).
A run's lines carry ``run_id``, the run's key (``user:epoch:first event:attempt``, see
``Claim.run_key``; the ``runs`` row's id exists only after the finish), and, when traces are
on (:mod:`vigil.tracing`), the run's ``trace_id``.

librdkafka's log lines come through the ``vigil.kafka`` logger (the clients' ``logger``
setting, see vigil.bus.kafka), so they are JSON too; the SDK's and httpx's per-request INFO
lines are dropped. A warning or error that repeats (the same text but for its numbers) on a
logger in ``REPEATING`` is written once per ``REPEAT_WINDOW_S``, then how many were left out
(with the next one, or in a line of its own once the window has passed): while the broker is
down a librdkafka consumer retries its bootstrap connection every 50 ms, which wrote 20 lines
a second per client (about 1,000 per worker in one chaos run), and ingest warned once per
refused request (a 503 per request for the whole outage).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import re
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO

# ``event``: a line's stable name (``extra={"event": "stale_finish"}``), on the lines the
# runbooks of docs/operations.md send an operator to: filter on it, not on the wording.
FIELDS = ("event", "user_id", "event_id", "run_id", "partition", "epoch", "trace_id", "mcp_server")
# Per-request INFO lines from HTTP clients (214 of 227 worker lines in one demo run were the
# SDK's "HTTP Request: POST ..."); warnings and errors from them still come through.
QUIET = ("httpx", "httpx2", "httpcore", "anthropic", "uvicorn.access", "psycopg.pool")

REPEAT_WINDOW_S = 30.0
# Loggers that write a line per attempt or per request while something is down.
REPEATING = ("vigil.kafka", "vigil.ingest.requests")
_NUMBERS = re.compile(r"\d+")

_context: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vigil_log_context", default=None)


@contextlib.contextmanager
def context(**fields) -> Iterator[None]:
    """Add ``fields`` to every line logged inside the block (this task or thread only)."""
    token = _context.set({**(_context.get() or {}), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        known = _context.get() or {}
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is None:
                value = known.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class Repeats(logging.Filter):
    """Let a warning or error through once per ``window_s`` per kind (its text with every
    number made alike, so "after 43878ms" and a port or a client's number do not make it
    new), then say how many were left out: with the next one through, or, if none comes, in a
    line of its own once the window has passed (a thread looks every half window), and at the
    latest when the process exits (a stop by signal goes through the interpreter's exit: the
    count of an outage that ended in the last window is not lost with it). Levels are kept
    apart: a repeated warning never hides an error. Lines under WARNING all pass: whoever
    turned DEBUG on wants each of them."""

    MAX_KINDS = 1_000

    def __init__(self, logger: logging.Logger, window_s: float, now=time.monotonic, flusher: bool = True):
        super().__init__()
        self.logger, self.window_s, self.now = logger, window_s, now
        self._lock = threading.Lock()  # librdkafka logs from the thread that polls each client
        # kind -> [window opened at, lines left out since, (its first line's text, file, line)]
        self._kinds: dict[tuple[int, str], list] = {}
        self._flusher = flusher
        self._stopped = threading.Event()
        _live.add(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        kind = (record.levelno, _NUMBERS.sub("#", text))
        now = self.now()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen[0] < self.window_s:
                seen[1] += 1
                if self._flusher:
                    self._flusher = False
                    threading.Thread(target=self._flush_every, name="log-repeats", daemon=True).start()
                return False
            if len(self._kinds) >= self.MAX_KINDS:
                self._kinds = {k: v for k, v in self._kinds.items() if now - v[0] < self.window_s}
            self._kinds[kind] = [now, 0, (text, record.pathname, record.lineno)]
        if seen is not None and seen[1]:
            record.msg, record.args = f"{text} ({self._note(seen[1], now - seen[0])})", None
        return True

    def _note(self, count: int, seconds: float) -> str:
        return f"{count} more like this since the last one logged ({seconds:.0f}s ago) were not logged"

    def flush(self, everything: bool = False) -> None:
        """Write the count for every window that has passed with lines left out (``everything``:
        every window, passed or not), as a line of the kind's level (the next line of the kind
        is then written whole)."""
        now = self.now()
        with self._lock:
            done = [(k, v) for k, v in self._kinds.items() if everything or now - v[0] >= self.window_s]
            for kind, _ in done:
                del self._kinds[kind]
        for (level, _), (opened, count, (text, path, line)) in done:
            if count:
                text = f"{text} ({self._note(count, now - opened)})"
                self.logger.callHandlers(self.logger.makeRecord(self.logger.name, level, path, line, text, None, None))  # type: ignore[arg-type]  # no args: the text is final

    def _flush_every(self) -> None:
        while not self._stopped.wait(self.window_s / 2):
            self.flush()

    def stop(self) -> None:
        self._stopped.set()
        _live.discard(self)


# The filters in use, for the exit's flush. Registered after logging's own exit handler, so it
# runs first (atexit is last in, first out) while the handlers are still open.
_live: weakref.WeakSet[Repeats] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for repeats in list(_live):
        repeats.flush(everything=True)


def setup(level: str = "INFO", fmt: str = "json", service: str = "vigil", stream: IO[str] | None = None) -> None:
    """Route every logger to ``stream`` (stderr) in ``fmt`` (json or text) at ``level``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in REPEATING:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, Repeats)]:
            old.stop()
            logger.removeFilter(old)
        logger.addFilter(Repeats(logger, REPEAT_WINDOW_S))
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # uvicorn installs its own handlers on its loggers when a server starts with log_config;
    # vigil starts it with log_config=None where it can, and its error logger propagates here.
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
