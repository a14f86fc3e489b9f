"""A small time-bounded cache for lookups on a hot path: ingest's tokens and hooks (ledger
reads), the console's tokens and the events topic's end offsets.

Why: ``POST /v1/events`` must not cost a database round trip per request, but a revoked
token must stop working soon. Entries live ``ttl`` seconds, so a revocation takes effect
within that bound on every replica. Only found rows are cached: a token or hook created a
moment ago works at once. Concurrent misses for one key share a single query, so a cache
expiry under load is one query, not one per waiting request.

Its own module, below the services that use it (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

V = TypeVar("V")

# A bound on memory whatever the table sizes; clearing everything at once is crude but only
# ever costs one query per live key.
MAX_ENTRIES = 10_000


class TtlCache(Generic[V]):
    def __init__(self, ttl: float):
        self.ttl = ttl
        self._entries: dict[str, tuple[float, V]] = {}
        self._loading: dict[str, asyncio.Future] = {}

    def age(self, key: str) -> float | None:
        """Seconds since ``key`` was loaded, or None if it is not cached."""
        entry = self._entries.get(key)
        return None if entry is None else time.monotonic() - entry[0]

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    async def get(self, key: str, load: Callable[[], Awaitable[V | None]]) -> V | None:
        entry = self._entries.get(key)
        if entry is not None and time.monotonic() - entry[0] < self.ttl:
            return entry[1]
        waiting = self._loading.get(key)
        if waiting is not None:
            await asyncio.wait([waiting])
            if not waiting.cancelled():
                return waiting.result()
            # The loader failed or its request went away: load for ourselves.
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        try:
            value = await load()
        except BaseException:
            future.cancel()
            raise
        finally:
            self._loading.pop(key, None)
        if value is not None and self.ttl > 0:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = (time.monotonic(), value)
        else:
            self._entries.pop(key, None)
        future.set_result(value)
        return value
