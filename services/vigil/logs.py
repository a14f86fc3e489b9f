"""Logging for every vigil process: one JSON object per line (or text for a terminal).

Fields of a JSON line: ``ts``, ``level``, ``service``, ``logger``, ``msg``, then whichever of
``user_id``, ``event_id``, ``run_id``, ``partition``, ``epoch``, ``trace_id`` the line knows,
and ``exc`` (the whole traceback as one string) for an exception. A line knows a field when
the call passes it (``log.info("...", extra={"partition": 3})``) or when the code around it
set it with :func:`context` (a contextvar: an asyncio task, such as one run, carries its own).
A run's lines carry ``run_id``, the run's key (``user:epoch:first event:attempt``, see
``Claim.run_key``; the ``runs`` row's id exists only after the finish), and, when traces are
on (:mod:`vigil.tracing`), the run's ``trace_id``.

librdkafka's log lines come through the ``vigil.kafka`` logger (the clients' ``logger``
setting, see vigil.bus.kafka), so they are JSON too; the SDK's and httpx's per-request INFO
lines are dropped.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO

FIELDS = ("user_id", "event_id", "run_id", "partition", "epoch", "trace_id")
# Per-request INFO lines from HTTP clients (214 of 227 worker lines in one demo run were the
# SDK's "HTTP Request: POST ..."); warnings and errors from them still come through.
QUIET = ("httpx", "httpx2", "httpcore", "anthropic", "uvicorn.access", "psycopg.pool")

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


def setup(level: str = "INFO", fmt: str = "json", service: str = "vigil", stream: IO[str] | None = None) -> None:
    """Route every logger to ``stream`` (stderr) in ``fmt`` (json or text) at ``level``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # uvicorn installs its own handlers on its loggers when a server starts with log_config;
    # vigil starts it with log_config=None where it can, and its error logger propagates here.
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
