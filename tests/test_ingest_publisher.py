"""The publisher serves delivery reports on its event loop: a send returns only with the
broker's acknowledgement, a send nobody acknowledges ends in a 503 at its deadline, and
closing answers what is still queued.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime

import pytest

from ingest_support import read_events
from vigil.envelope import Event
from vigil.ingest.publisher import Publisher
from vigil.ingest.requests import Refusal
from vigil.settings import CommonSettings
from vigil_dev.devstack import free_port


def _event(n: int) -> Event:
    return Event(
        user_id=f"u{n % 7}",
        source="tests",
        source_id=f"pub-{n}",
        kind="test.event",
        payload="{}",
        received_at=datetime.now(UTC),
    )


def test_concurrent_sends_return_with_their_acknowledgements_and_no_poll_thread(stack, topics):
    settings = CommonSettings(kafka_bootstrap=stack.bootstrap, events_topic=topics.events, produce_timeout_s=10.0)

    async def run() -> list:
        publisher = Publisher(settings)
        await publisher.start()
        try:
            results = await asyncio.gather(
                *(publisher.send([_event(n)], via="events") for n in range(40)),
                publisher.send([_event(n) for n in range(40, 90)], via="events"),
            )
            assert not [t for t in threading.enumerate() if t.name == "producer-poll"]
            return results
        finally:
            await publisher.close()

    results = asyncio.run(run())
    assert [len(r) for r in results] == [1] * 40 + [50]
    offsets = {(d.partition, d.offset) for r in results for d in r}
    assert len(offsets) == 90  # one stored copy each, each with its own offset
    stored = read_events(stack.bootstrap, topics.events, 90, partitions=topics.partitions)
    assert sorted(e.source_id for e in stored) == sorted(f"pub-{n}" for n in range(90))


def test_send_nobody_acknowledges_is_a_503_at_its_deadline():
    settings = CommonSettings(kafka_bootstrap=f"127.0.0.1:{free_port()}", events_topic="nowhere", produce_timeout_s=1.0)

    async def run() -> float:
        publisher = Publisher(settings)
        await publisher.start()
        started = time.monotonic()
        try:
            with pytest.raises(Refusal) as refused:
                await publisher.send([_event(1)], via="events")
            assert refused.value.status == 503 and refused.value.code == "broker_unavailable"
            assert refused.value.headers.get("Retry-After")
            return time.monotonic() - started
        finally:
            await publisher.close(timeout=0.5)

    elapsed = asyncio.run(run())
    assert 0.9 < elapsed < 5.0  # librdkafka's message timeout (1 s), not a hang
