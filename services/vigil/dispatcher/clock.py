"""The dispatcher's sense of time, injectable so tests can cover hours in milliseconds.

Every pacing and backoff decision compares against :meth:`Clock.now` passed into SQL as a
parameter, never against the database's ``now()``: with one clock in charge, a test that
moves the clock moves everything (gaps, backoffs, send leases, the urgent cap's day).
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to (in-process tests)."""

    def __init__(self, start: datetime):
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def set(self, at: datetime) -> None:
        with self._lock:
            self._now = at

    def advance(self, seconds: float) -> datetime:
        with self._lock:
            self._now += timedelta(seconds=seconds)
            return self._now


class FileClock:
    """Unix seconds read from a file on every call (the test hook for dispatcher processes).

    A test rewrites the file to move a running dispatcher through time. An unreadable file
    (caught mid-rewrite) keeps the last value rather than jumping.
    """

    def __init__(self, path: Path):
        self.path = path
        self._last = self._read()
        if self._last is None:
            raise ValueError(f"{path}: no Unix seconds in it")

    def _read(self) -> datetime | None:
        try:
            return datetime.fromtimestamp(float(self.path.read_text().strip()), UTC)
        except (OSError, ValueError):
            return None

    def now(self) -> datetime:
        value = self._read()
        if value is not None:
            self._last = value
        return self._last


def write_clock_file(path: Path, at: datetime) -> None:
    """Move the processes reading ``path`` to ``at`` (atomic: they never see half a number)."""
    scratch = path.with_suffix(".tmp")
    scratch.write_text(f"{at.timestamp():.6f}")
    scratch.replace(path)
