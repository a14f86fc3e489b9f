"""The worker's side of the fencing rule (the rule itself: :mod:`vigil.ledger.partitions`):
an assignment is a takeover, of every newly assigned partition in one transaction."""

from __future__ import annotations

import logging

import psycopg

from vigil.ledger import partitions as ledger_partitions
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics

log = logging.getLogger(__name__)

__all__ = ["PartitionKey", "take_over"]


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
            epoch = ledger_partitions.take_over(conn, key, holder)
            recovered = ledger_partitions.hand_back_stale_claims(
                conn, key, epoch, backoff_base_s, backoff_cap_s, max_attempts
            )
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
