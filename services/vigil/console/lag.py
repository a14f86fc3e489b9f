"""Consumer lag on the partitions page: the broker's end offsets minus the ledger's positions.

The ledger knows, per partition, the next offset it will record (``consumer_positions``,
written with the events it covers); only the broker knows where the partition ends. The
console asks it for the high watermarks with a short timeout and keeps the answer a few
seconds, so the page costs at most one bounded broker round trip per few seconds however
often it is loaded. A broker that does not answer (down, wrong address, no such topic) makes
the lag "unknown" on the page, never an error: the console's pages need the ledger only.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from starlette.concurrency import run_in_threadpool

from vigil.bus.kafka import end_offsets, quiet_admin
from vigil.ledger.console import PartitionRow
from vigil.settings import CommonSettings
from vigil.ttl_cache import TtlCache

log = logging.getLogger(__name__)

# The page waits at most this long for the broker: long enough for a broker on the same
# network (a few ms), short enough that an unreachable one costs a page one second.
KAFKA_TIMEOUT_S = 1.0
# End offsets and failures are kept this long: lag moves by the second anyway, and a page
# reloaded in a loop must not become a loop of broker requests (or of one-second waits).
CACHE_S = 5.0
# A bound on the topics asked about for one page (the ledger names each one it recorded from).
MAX_TOPICS = 8


@dataclass(frozen=True)
class Ends:
    """One topic's end offsets as the broker gave them, or why there are none."""

    offsets: dict[int, int]
    at: float  # time.monotonic() of the answer
    error: str | None = None


@dataclass(frozen=True)
class PartitionLag:
    """A partitions-page row: the ledger's facts and the broker's end offset, if it answered."""

    row: PartitionRow
    end_offset: int | None  # None: unknown (the broker did not answer, or has no such partition)

    @property
    def lag(self) -> int | None:
        """Messages in Kafka the ledger has not recorded yet; None if unknown. With no position
        the ledger never recorded from the partition: everything up to the end is behind."""
        if self.end_offset is None:
            return None
        return self.end_offset - (self.row.next_offset or 0)


class EndOffsets:
    """The broker's end offsets per topic, cached, asked off the event loop."""

    def __init__(self, settings: CommonSettings):
        self.settings = settings
        self.cache: TtlCache[Ends] = TtlCache(CACHE_S)
        self._admin: AdminClient | None = None
        self._lock = threading.Lock()

    def _client(self) -> AdminClient:
        with self._lock:
            if self._admin is None:
                self._admin = quiet_admin(self.settings)
            return self._admin

    def _ask(self, topic: str) -> Ends:
        started = time.monotonic()
        try:
            return Ends(end_offsets(self._client(), topic, KAFKA_TIMEOUT_S), time.monotonic())
        except (KafkaException, TimeoutError) as exc:
            log.warning("no end offsets for %s after %.1fs: %s", topic, time.monotonic() - started, exc)
            return Ends({}, time.monotonic(), f"the broker did not answer: {exc}")

    async def of(self, topic: str) -> Ends:
        ends = await self.cache.get(topic, lambda: run_in_threadpool(self._ask, topic))
        assert ends is not None  # _ask always answers (a failure is an Ends with its error)
        return ends

    async def lags(self, rows: list[PartitionRow], topics: list[str]) -> tuple[list[PartitionLag], dict[str, Ends]]:
        """``rows`` with their end offsets, plus a row for each partition the broker has and the
        ledger never saw (a partition no worker was ever assigned is lag the ledger cannot see).
        ``topics``: those to ask about besides the rows' own (the events topic)."""
        wanted = list(dict.fromkeys([*topics, *(r.topic for r in rows)]))[:MAX_TOPICS]
        ends = {topic: await self.of(topic) for topic in wanted}
        seen = {(r.topic, r.partition) for r in rows}
        unseen = [
            PartitionRow(topic, p, None, None, None, None, None, None, 0, False)
            for topic, e in ends.items()
            for p in e.offsets
            if (topic, p) not in seen
        ]
        joined = [
            PartitionLag(r, ends[r.topic].offsets.get(r.partition) if r.topic in ends else None) for r in rows + unseen
        ]
        joined.sort(key=lambda x: (x.row.topic, x.row.partition))
        return joined, ends


def answered_at(ends: Ends, now: datetime) -> datetime:
    """The wall-clock time of a cached answer, for "as of" on the page."""
    return now - timedelta(seconds=max(0.0, time.monotonic() - ends.at))
