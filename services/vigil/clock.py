"""The one clock every service reads its time from, injectable so tests can move it.

One unit everywhere: seconds as ``float``. :meth:`Clock.now` is wall time (Unix epoch
seconds: what is compared with the ledger's timestamps, due times, backoffs, leases);
:meth:`Clock.monotonic` measures intervals and in-process deadlines (when the next claim pass
is due, how long a drain has lasted), which must not jump when the host's clock is set.
Callers that hand a time to SQL convert it with :func:`utc`. A service takes a ``clock``
(default :class:`SystemClock`); a test gives it a :class:`ManualClock` and moves time by
hand, or (for a separate process) points ``VIGIL_DISPATCHER_CLOCK_FILE`` at a file it
rewrites (:class:`FileClock`). docs/architecture.md, "Time".
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall time, Unix epoch seconds."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: compare only with another ``monotonic()``."""
        ...


class SystemClock:
    """The host's clocks: what every service runs on outside tests."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to: every read sees exactly the instant set.

    ``now`` and ``monotonic`` move together (one instant), so a test that advances it moves
    both due times and intervals. Thread-safe: the dispatcher reads it from its send threads.
    """

    def __init__(self, start: float = 0.0):
        self._instant = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._instant

    def monotonic(self) -> float:
        return self.now()

    def set(self, instant: float) -> None:
        with self._lock:
            self._instant = float(instant)

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._instant += seconds
            return self._instant


class FileClock:
    """Wall time read from a file on every call (the test hook for a service in its own process).

    A test rewrites the file (:func:`write_clock_file`) to move a running process through
    time. An unreadable file (caught mid-rewrite) keeps the last value rather than jumping.
    Intervals stay on the host's monotonic clock: the hook moves due times, not timeouts.
    """

    def __init__(self, path: Path):
        self.path = path
        last = self._read()
        if last is None:
            raise ValueError(f"{path}: no Unix seconds in it")
        self._last = last

    def _read(self) -> float | None:
        try:
            return float(self.path.read_text().strip())
        except (OSError, ValueError):
            return None

    def now(self) -> float:
        value = self._read()
        if value is not None:
            self._last = value
        return self._last

    def monotonic(self) -> float:
        return time.monotonic()


def utc(seconds: float) -> datetime:
    """Epoch seconds as an aware UTC ``datetime`` (what psycopg sends as ``timestamptz``)."""
    return datetime.fromtimestamp(seconds, UTC)


def write_clock_file(path: Path, seconds: float) -> None:
    """Move the processes reading ``path`` to ``seconds`` (atomic: they never see half a number)."""
    scratch = path.with_suffix(".tmp")
    scratch.write_text(f"{seconds:.6f}")
    scratch.replace(path)
