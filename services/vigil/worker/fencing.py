"""The fencing rule: one active run per user, whatever the consumer group does.

Kafka decides which worker *should* own a partition; the ledger decides which one *does*.
Each topic partition has a row in ``partitions`` with an ``epoch``:

1. **Assignment is a takeover.** When the group assigns a partition to a worker, that worker
   increments the partition's epoch in one transaction (:func:`take_over`) and hands every
   event left ``running`` under an older epoch back to ``pending``: the worker that claimed
   it lost the partition, maybe by crashing, maybe by freezing past its session timeout.
   The lost claim counts as an attempt, but never as the last one unless the event ran
   alone (claim rule 3 in :mod:`vigil.worker.claims`).
2. **Claims and finishes are fenced.** Both lock the partition row ``FOR SHARE`` and check
   ``epoch = my_epoch`` (queries ``claim``, ``lock_epochs``). The takeover's ``UPDATE`` of that
   row therefore waits for in-flight claims and finishes, and once it commits, every later
   write of the old owner matches nothing: a slow worker that wakes up after a rebalance
   cannot finish its stale claim, cannot write outbox rows, cannot set timers.
3. **Claims are made by the owner of the user's home partition** (``users.home_partition``,
   fixed at the first event seen), not by whoever consumed the event, so a producer with
   another partitioner, or a topic whose partition count grew, cannot give one user two
   concurrent runs.

Checking the holder's name alone is not enough: a frozen worker resumes believing it still
holds the partition, and its name is still in the row until someone else writes theirs.
The epoch only ever grows, so "my epoch is the current one" is a fact the database checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg

from vigil.ledger.queries import Q
from vigil.worker import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, order=True)
class PartitionKey:
    topic: str
    partition: int


def take_over(
    conn: psycopg.Connection,
    partitions: list[PartitionKey],
    holder: str,
    backoff_base_s: float,
    backoff_cap_s: float,
    max_attempts: int,
) -> dict[PartitionKey, int]:
    """Rule 1, for every newly assigned partition in one transaction. Returns the new epochs.

    Partitions are taken in sorted order so that two workers taking over overlapping sets
    cannot deadlock. A crash before the commit leaves the old epochs: the next assignment
    takes over again.
    """
    epochs: dict[PartitionKey, int] = {}
    with conn.transaction():
        for key in sorted(partitions):
            row = conn.execute(
                Q.take_over_partition, {"topic": key.topic, "partition": key.partition, "holder": holder}
            ).fetchone()
            epoch = row["epoch"] if isinstance(row, dict) else row[0]
            recovered = conn.execute(
                Q.hand_back_stale_claims,
                {
                    "topic": key.topic,
                    "partition": key.partition,
                    "epoch": epoch,
                    "backoff_base": backoff_base_s,
                    "backoff_cap": backoff_cap_s,
                    "max_attempts": max_attempts,
                },
            ).fetchall()
            epochs[key] = epoch
            if recovered:
                metrics.HANDED_BACK.inc(len(recovered))
                log.warning(
                    "took over %s[%d] at epoch %d: %d claim(s) of the previous owner back to pending",
                    key.topic,
                    key.partition,
                    epoch,
                    len(recovered),
                )
    log.info("partitions taken over: %s", ", ".join(f"{k.partition}@{e}" for k, e in sorted(epochs.items())))
    return epochs
