"""Several ledger shards: a polled batch split by shard, and the events read on another
shard's partition produced again to their user's home partition.

:class:`vigil.worker.shards.Shards` decides each route (``shard_of``, ``elsewhere``); this
module applies them to what the consumer polled. One shard (the default) never comes here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

from confluent_kafka import Message

from vigil.bus.kafka import EventProducer
from vigil.ledger.events import USER_COLUMN
from vigil.worker import metrics
from vigil.worker.deadletters import until_acknowledged
from vigil.worker.shards import Shards

log = logging.getLogger("vigil.worker.consumer")  # the consumer thread's lines keep their logger

# A staging row is ``(index, *the event's fields, topic, partition, offset)`` (the consumer's ``_decode``).
PARTITION_COLUMN = -2
TOPIC_COLUMN = -3
OFFSET_COLUMN = -1

Row = tuple[Any, ...]
Offsets = dict[tuple[str, int], int]  # (topic, partition) -> an offset


class Batch(NamedTuple):
    """What one shard's transaction records of a polled batch."""

    shard: int
    rows: list[Row]
    highest: Offsets  # its partitions' highest offsets polled
    unknown: list[str]  # its users this process has not seen committed there
    lowest: Offsets | None = None  # several shards: where to read again if it fails


def by_shard(shards: Shards, rows: list[Row], highest: Offsets, messages: list[Message]) -> list[Batch]:
    """A polled batch split by the shard of each partition: its events and positions, and
    each partition's first offset polled (where to read again if its shard fails)."""
    batches: dict[int, Batch] = {}
    for (topic, partition), offset in highest.items():
        shard = shards.shard_of(partition)
        batches.setdefault(shard, Batch(shard, [], {}, [], {})).highest[topic, partition] = offset
    for m in reversed(messages):  # a partition's messages in offset order: the first one wins
        m_topic, m_partition, m_offset = m.topic(), m.partition(), m.offset()
        assert m_topic is not None and m_partition is not None and m_offset is not None  # a polled message has them
        b = batches.get(shards.shard_of(m_partition))
        if b is not None and b.lowest is not None and (m_topic, m_partition) in b.highest:
            b.lowest[m_topic, m_partition] = m_offset
    for row in rows:
        batches[shards.shard_of(row[PARTITION_COLUMN])].rows.append(row)
    return [batches[shard] for shard in sorted(batches)]


def reroute(
    shards: Shards,
    rows: list[Row],
    messages: list[Message],
    producer: EventProducer,
    topic: str,
    partitions: int,
    stopping: threading.Event,
) -> list[Row] | None:
    """The rows to record here; those whose user's home partition (among ``partitions``,
    VIGIL_PARTITIONS) is on another shard (a producer with another partitioner, a topic
    grown past VIGIL_PARTITIONS) are produced again, verbatim, to that partition of ``topic``
    and acknowledged first, so their offsets are stored only after that (a crash in between
    produces them again: the home shard's dedup key drops the copy). None: the worker
    stopped first."""
    kept: list[Row] = []
    away: dict[int, list[Row]] = {}
    for row in rows:
        home = shards.elsewhere(row[USER_COLUMN], row[PARTITION_COLUMN], partitions=partitions)
        if home is None:
            kept.append(row)
        else:
            away.setdefault(home, []).append(row)
    if not away:
        return rows
    read = {(m.partition(), m.offset()): m for m in messages}
    for home, foreign in sorted(away.items()):
        copies = [
            (m.key(), m.value(), m.headers()) for m in (read[r[PARTITION_COLUMN], r[OFFSET_COLUMN]] for r in foreign)
        ]

        def produce(copies: list[tuple[Any, ...]] = copies, home: int = home) -> object:
            return producer.send_raw(copies, topic, partition=home)

        if not until_acknowledged("producing events again to their home partition", produce, stopping):
            return None
        metrics.EVENTS_REROUTED.inc(len(foreign))
        log.info(
            "%d event(s) read on partition(s) of another shard produced again to their home partition %d",
            len(foreign),
            home,
        )
    return kept
