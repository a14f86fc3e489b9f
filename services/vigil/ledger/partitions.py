"""The fencing rule, over ``queries/partitions.sql``: one active run per user, whatever the
consumer group does.

Kafka decides which worker *should* own a partition; the ledger decides which one *does*.
Each topic partition has a row in ``partitions`` with an ``epoch``:

1. **Assignment is a takeover.** When the group assigns a partition to a worker, that worker
   increments the partition's epoch (:func:`take_over`) and, in the same transaction, hands
   every event left ``running`` under an older epoch back to ``pending``
   (:func:`hand_back_stale_claims`): the worker that claimed it lost the partition, maybe by
   crashing, maybe by freezing past its session timeout. The lost claim counts as an
   attempt, but never as the last one unless the event ran alone (claim rule 3 in
   :mod:`vigil.ledger.claims`).
2. **Claims and finishes are fenced.** Both lock the partition row ``FOR SHARE`` and check
   ``epoch = my_epoch`` (the claim statements, :func:`lock_epochs`). The takeover's
   ``UPDATE`` of that row therefore waits for in-flight claims and finishes, and once it
   commits, every later write of the old owner matches nothing: a slow worker that wakes up
   after a rebalance cannot finish its stale claim, cannot write outbox rows, cannot set
   timers.
3. **Claims are made by the owner of the user's home partition** (``users.home_partition``,
   fixed at the first event seen), not by whoever consumed the event, so a producer with
   another partitioner, or a topic whose partition count grew, cannot give one user two
   concurrent runs.

4. **A revoke with runs in flight hands the partition over.** The revoking owner stops
   claiming for it, sets the row's ``handover_until`` (:func:`begin_handover`, at its epoch)
   and lets the consumer go on; its runs of the partition keep finishing under that epoch,
   which is still the current one, because the next owner's takeover waits until the deadline
   passes or the revoking owner clears it (:func:`end_handover`, once its last run of the
   partition is gone; :func:`handover_left` is the wait). A revoking owner that dies leaves the
   deadline, and the takeover after it is rule 1 as ever. The takeover clears the deadline.

Checking the holder's name alone is not enough: a frozen worker resumes believing it still
holds the partition, and its name is still in the row until someone else writes theirs.
The epoch only ever grows, so "my epoch is the current one" is a fact the database checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True, order=True)
class PartitionKey:
    topic: str
    partition: int


def owned_params(owned: dict[PartitionKey, int]) -> dict[str, Any]:
    """The owned partitions and their epochs as the statements take them: three arrays in one order."""
    keys = sorted(owned)
    return {
        "topics": [k.topic for k in keys],
        "partitions": [k.partition for k in keys],
        "epochs": [owned[k] for k in keys],
    }


def keys_params(keys: list[PartitionKey]) -> dict[str, Any]:
    return {"topics": [k.topic for k in keys], "partitions": [k.partition for k in keys]}


def take_over(conn: psycopg.Connection[DictRow], key: PartitionKey, holder: str) -> int:
    """Rule 1's first half: bump the partition's epoch (waits for in-flight claims and
    finishes holding the row). Returns the new epoch."""
    row = conn.execute(Q.take_over_partition, {"topic": key.topic, "partition": key.partition, "holder": holder})
    found = row.fetchone()
    assert found is not None
    epoch: int = found["epoch"] if isinstance(found, dict) else found[0]
    return epoch


def hand_back_stale_claims(
    conn: psycopg.Connection[DictRow],
    *,
    key: PartitionKey,
    epoch: int,
    backoff_base_s: float,
    backoff_cap_s: float,
    max_attempts: int,
    verdict_s: float,
    now: datetime | None = None,
) -> list[int]:
    """Rule 1's second half: the partition's events still claimed under an older epoch back to
    pending with a backoff from ``now``; a lone last attempt's death waits ``verdict_s`` for
    its worker to say it was alive (claims' ``forgive_lost_claims``). Returns their ids."""
    rows = conn.execute(
        Q.hand_back_stale_claims,
        {
            "topic": key.topic,
            "partition": key.partition,
            "epoch": epoch,
            "backoff_base": backoff_base_s,
            "backoff_cap": backoff_cap_s,
            "max_attempts": max_attempts,
            "verdict_s": verdict_s,
            "now": now,
        },
    ).fetchall()
    return [row["id"] if isinstance(row, dict) else row[0] for row in rows]


async def begin_handover(
    conn: psycopg.AsyncConnection[DictRow],
    partitions: dict[PartitionKey, int],
    seconds: float,
    *,
    now: datetime | None = None,
) -> list[PartitionKey]:
    """Rule 4: a hand-over deadline ``seconds`` after ``now`` on ``partitions`` still at these
    epochs. Returns those it was set on (the others have moved on already)."""
    cur = await conn.execute(Q.begin_handover, {**owned_params(partitions), "seconds": seconds, "now": now})
    return sorted(PartitionKey(row["topic"], row["partition"]) for row in await cur.fetchall())


async def end_handover(conn: psycopg.AsyncConnection[DictRow], partitions: dict[PartitionKey, int]) -> None:
    """Rule 4: the revoking owner's last run of ``partitions`` (at these epochs) is gone."""
    await conn.execute(Q.end_handover, owned_params(partitions))


def handover_left(
    conn: psycopg.Connection[DictRow], keys: list[PartitionKey], *, now: datetime | None = None
) -> float | None:
    """Rule 4, for a takeover: seconds from ``now`` until the last hand-over deadline among
    ``keys``; None when none is in progress."""
    row = conn.execute(Q.handover_left, {**keys_params(sorted(keys)), "now": now}).fetchone()
    seconds = None if row is None else (row["seconds"] if isinstance(row, dict) else row[0])
    return None if seconds is None else float(seconds)


async def lock_epochs(conn: psycopg.AsyncConnection[DictRow], homes: list[PartitionKey]) -> dict[PartitionKey, int]:
    """Rule 2 for a finish: lock ``homes``' rows ``FOR SHARE`` (a takeover waits for this
    transaction) and return their current epochs."""
    cur = await conn.execute(Q.lock_epochs, keys_params(sorted(homes)))
    return {PartitionKey(row["topic"], row["partition"]): row["epoch"] for row in await cur.fetchall()}
