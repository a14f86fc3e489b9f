"""A bound on the ledger work that unknown keys cause on ingest's hot path (tokens, hooks).

The cache of the keys that exist is :class:`vigil.ttl_cache.TtlCache`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from vigil.ingest.metrics import UNKNOWN_KEYS


class MissGuard:
    """A bound on the ledger work that unknown keys (random tokens, made-up hook ids) cause.

    Lookups of keys that turn out unknown are not cached by :class:`TtlCache` (a token created
    a moment ago must work at once), so a flood of random tokens was a flood of queries, and
    a legitimate request queued behind them (5 ms became 174 ms at 3,000 random tokens).
    Up to ``budget`` unknown keys per second are looked up one by one; past that, a key is
    first checked against the set of every existing key (``load_all``, one query, reloaded
    at most once a second), and only a key in that set is looked up. Under a flood, a key
    created less than a second ago may therefore be refused once.
    """

    def __init__(
        self, kind: str, load_all: Callable[[], Awaitable[frozenset[str]]], budget: int = 50, refresh_s: float = 1.0
    ):
        self.load_all = load_all
        self._counted = (UNKNOWN_KEYS.labels(kind, "true"), UNKNOWN_KEYS.labels(kind, "false"))
        self.budget = budget
        self.refresh_s = refresh_s
        self._window = 0.0
        self._misses = 0
        self._known: frozenset[str] | None = None
        self._known_at = 0.0
        self._loading: asyncio.Future | None = None

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
