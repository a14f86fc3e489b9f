"""A small time-bounded cache for lookups on a hot path: ingest's tokens and hooks (ledger
reads), the console's tokens and sessions and the events topic's end offsets; and
:class:`MissGuard`, the bound on what the keys that are not there cost.

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

from prometheus_client import Counter

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


class MissGuard:
    """A bound on the ledger work that unknown keys (random tokens, made-up hook ids, the
    console's unknown tokens and cookies, made-up approval ids) cause.

    Lookups of keys that turn out unknown are not cached by :class:`TtlCache` (a token created
    a moment ago must work at once), so a flood of random tokens was a flood of queries, and
    a legitimate request queued behind them (5 ms became 174 ms at 3,000 random tokens).
    Up to ``budget`` unknown keys per second are looked up one by one; past that, a key is
    first checked against the set of every existing key (``load_all``, one query, reloaded
    at most once a second), and only a key in that set is looked up. Under a flood, a key
    created less than a second ago may therefore be refused once.
    """

    def __init__(
        self,
        counted: Counter,
        kind: str,
        load_all: Callable[[], Awaitable[frozenset[str]]],
        budget: int = 50,
        refresh_s: float = 1.0,
    ):
        self.load_all = load_all
        # The caller's counter of unknown keys, labelled (kind, looked_up).
        self._counted = (counted.labels(kind, "true"), counted.labels(kind, "false"))
        self.budget = budget
        self.refresh_s = refresh_s
        self._window = 0.0
        self._misses = 0
        self._known: frozenset[str] | None = None
        self._known_at = 0.0
        self._loading: asyncio.Future | None = None

    async def get(self, cache: TtlCache[V], key: str, load: Callable[[], Awaitable[V | None]]) -> V | None:
        """``cache.get(key, load)``, unless ``key`` is not worth a query (see the class); a
        miss is counted either way."""
        looked_up = cache.age(key) is not None or await self.worth_looking_up(key)
        value = await cache.get(key, load) if looked_up else None
        if value is None:
            self.missed(looked_up)
        return value

    def missed(self, looked_up: bool = True) -> None:
        """A key was unknown; if the ledger was asked, it counts against this second's budget."""
        self._counted[0 if looked_up else 1].inc()
        if not looked_up:
            return
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._misses = now, 0
        self._misses += 1

    async def worth_looking_up(self, key: str) -> bool:
        now = time.monotonic()
        if now - self._window >= 1.0 or self._misses < self.budget:
            return True
        if self._known is None or now - self._known_at >= self.refresh_s:
            if self._loading is None:
                self._loading = asyncio.ensure_future(self.load_all())
                loading = self._loading
                try:
                    self._known = await loading
                    self._known_at = time.monotonic()
                finally:
                    self._loading = None
            else:
                await asyncio.wait([self._loading])
        return self._known is not None and key in self._known
