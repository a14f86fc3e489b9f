"""Kafka's default partitioner, in Python: which partition of the events topic a user's events
land on (their *home partition*), as every producer computes it.

vigil's producers use librdkafka's ``murmur2_random`` partitioner, which is the Java client's
default; other producers of the contract use the Java client or one configured like it. The
ledger needs the same answer without a producer: the shard map routes an operator's command
for one user to the shard of that user's home partition (:mod:`vigil.ledger.shardmap`).
"""

from __future__ import annotations


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), as a signed int32."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | (data[i + 3] << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length % 4
    base = length - tail
    if tail == 3:
        h ^= data[base + 2] << 16
    if tail >= 2:
        h ^= data[base + 1] << 8
    if tail >= 1:
        h ^= data[base]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def java_partition(key: bytes, partitions: int) -> int:
    """The partition the Java client's default partitioner picks for a keyed record."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def home_partition(user_id: str, partitions: int) -> int:
    """The partition a user's events are keyed to (the key is the user id, UTF-8)."""
    return java_partition(user_id.encode(), partitions)
