"""The worker's side of the fencing rule (the rule itself: :mod:`vigil.ledger.partitions`):
an assignment is a takeover, of every newly assigned partition in one transaction, after the
previous owner's hand-over (rule 4) of any of them has ended."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.clock import Clock, utc
from vigil.ledger import partitions as ledger_partitions
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics

log = logging.getLogger(__name__)


# How often a takeover looks whether the previous owner's hand-over has ended.
HANDOVER_POLL_S = 0.05


def _now(clock: Clock | None) -> datetime | None:
    """The instant the ledger decides at: the worker's clock, or (None) the ledger's own."""
    return None if clock is None else utc(clock.now())


def handing_over(
    conn: psycopg.Connection[DictRow], partitions: list[PartitionKey], clock: Clock | None = None
) -> set[PartitionKey]:
    """Which of ``partitions`` a previous owner is handing over now (rule 4), each looked up
    in its own short transaction: an assignment is rare and holds a dozen partitions at most."""
    found = set()
    for key in partitions:
        if ledger_partitions.handover_left(conn, [key], now=_now(clock)) is not None:
            found.add(key)
        conn.commit()
    return found


def wait_for_handover(
    conn: psycopg.Connection[DictRow],
    partitions: list[PartitionKey],
    within_s: float,
    given_up: Callable[[], bool] = lambda: False,
    clock: Clock | None = None,
) -> float:
    """Rule 4: until no hand-over of ``partitions`` is in progress (the previous owner cleared
    it, or its deadline passed: a revoking worker that died), at most ``within_s`` (a
    takeover after that fences the previous owner out, as for a lost partition). Returns the
    seconds waited. The consumer records the partitions meanwhile: only claims wait.

    No lock is held meanwhile: each look is its own short transaction. The revoking worker
    cannot set a new deadline after it (the group gave the partitions to us), so the
    takeover that follows sees none. ``given_up()`` true ends the wait early (the partitions
    were revoked meanwhile)."""
    began = time.monotonic()
    while time.monotonic() - began < within_s and not given_up():
        left = ledger_partitions.handover_left(conn, partitions, now=_now(clock))
        conn.commit()
        if left is None:
            break
        time.sleep(min(max(left, 0.0), HANDOVER_POLL_S))
    waited = time.monotonic() - began
    metrics.HANDOVER_WAIT_SECONDS.observe(waited)
    if waited >= HANDOVER_POLL_S:
        log.info(
            "waited %.1fs for the previous owner's hand-over of %s",
            waited,
            ", ".join(str(k.partition) for k in sorted(partitions)),
        )
    return waited


def take_over(
    conn: psycopg.Connection[DictRow],
    partitions: list[PartitionKey],
    holder: str,
    backoff_base_s: float,
    backoff_cap_s: float,
    max_attempts: int,
    handover_within_s: float = 60.0,
    clock: Clock | None = None,
    verdict_s: float = 30.0,
) -> dict[PartitionKey, int]:
    """Rule 1, for every newly assigned partition in one transaction, once no hand-over of
    them is in progress (rule 4, :func:`wait_for_handover`, at most ``handover_within_s``;
    0: the caller has waited already). Returns the new epochs. ``clock``: what the hand-over
    deadlines and the handed-back claims' backoffs are decided on (None: the ledger's clock).
    ``verdict_s``: how long a lone last attempt handed back waits before it is its event's
    death (its worker, alive, may give it back: :func:`vigil.ledger.claims.forgive_lost_claims`).

    Partitions are taken in sorted order so that two workers taking over overlapping sets
    cannot deadlock. A crash before the commit leaves the old epochs: the next assignment
    takes over again.
    """
    if handover_within_s > 0:
        wait_for_handover(conn, partitions, handover_within_s, clock=clock)
    epochs: dict[PartitionKey, int] = {}
    with conn.transaction():
        for key in sorted(partitions):
            epoch = ledger_partitions.take_over(conn, key, holder)
            recovered = ledger_partitions.hand_back_stale_claims(
                conn,
                key=key,
                epoch=epoch,
                backoff_base_s=backoff_base_s,
                backoff_cap_s=backoff_cap_s,
                max_attempts=max_attempts,
                verdict_s=verdict_s,
                now=_now(clock),
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
