"""The claim rules, executed by the statements of ``queries/claims.sql``:

1. Rows ``running`` under an older epoch go back to ``pending`` (done at takeover, see
   :mod:`vigil.ledger.partitions`; a claim only ever matches the current epoch).
2. Rows ``pending`` with ``attempts >= max_attempts`` become ``dead`` (:func:`mark_dead`),
   with a record on the dead-letter topic: a poison event must never silently mute an agent.
3. If the user's oldest pending row is a retry (``attempts > 0``), it is claimed alone once
   its backoff ended, so a poison event cannot take healthy events down with it; otherwise
   all fresh pending rows of the user up to ``batch_max`` are claimed together, once the
   oldest has waited out the batch window (three quick chat messages: one run, one reply).
   Later fresh rows wait behind a retry, so runs follow event order per user.
   **The last attempt of an event lost with its worker before runs alone**
   (:func:`claim_alone`): the runner claims it only with no other run in flight (it waits
   for them up to ``VIGIL_LONE_DRAIN_S``, then releases the rest) and claims nothing else
   until it finishes. A crash takes down every run in flight, and each lost
   claim counted an attempt; so the takeover never lets a claim lost in company use up an
   event's last attempt (query ``hand_back_stale_claims``), and a crash becomes an event's
   death only when the event ran alone, and its worker did not come back alive within the
   verdict's wait to say it was no crash (:func:`forgive_lost_claims`). A poison event that
   kills its worker therefore dies after ``max_attempts`` claims, the last of them alone,
   and the events that happened to run beside it lose at most ``max_attempts - 1``
   attempts, never their lives. A journaled
   batch on its first event's lone last attempt replays whole once, uncounted
   (:func:`claim_ids_alone`; its journal stamped): lost only in company, it finishes with the
   keys it had; crashing alone, it is split at the next lone attempt. Such an attempt is at
   its user's turn when its event is the first of the user's run in progress (a live
   journal), even behind an older event an operator retried: that run goes first.
4. No claim for a user who already has a ``running`` row under the current epoch.

Attempts are counted at claim time, because a worker that crashes mid-run records nothing.

Who gets the free run slots: waiting users round-robin in ``user_id`` order from a cursor
kept by the runner, so every waiting user gets a turn before anyone gets a second one, and
a pass reads only the users it looks at (never the whole backlog: a worker that falls
behind must not get slower at catching up).

A claim is given back by :func:`release_claim` (graceful: partition revoked, shutdown; the
attempt not counted), by the finish of a failed attempt (:mod:`vigil.ledger.finish`), by a
takeover (rule 1) or by the heal (:mod:`vigil.ledger.recovery`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import psycopg
import pydantic_core
from psycopg.rows import DictRow

from vigil.ledger import db
from vigil.ledger.events import EventRow
from vigil.ledger.partitions import PartitionKey, keys_params, owned_params
from vigil.ledger.queries import Q


@dataclass(slots=True)
class Claim:
    """One user's claimed events: the unit a run works on."""

    user_id: str
    home: PartitionKey
    epoch: int
    events: list[EventRow]
    transient_failures: int
    oldest_recorded_at: datetime
    # The run's span context (W3C traceparent) when traces are on: its outbox rows and timers
    # carry it, so the delivery and a follow-up continue the trace (vigil.worker.traces).
    traceparent: str | None = None

    @property
    def event_ids(self) -> list[int]:
        return [event.id for event in self.events]

    @property
    def run_key(self) -> str:
        """The run's identity (RunContext.run_key, tasks.parent_run_key, the logs' run_id, the
        journal's key): the same across attempts, epochs and workers until its events finish
        (:mod:`vigil.ledger.journal`, rule 1)."""
        return f"{self.user_id}:{self.events[0].id}"

    @property
    def attempt(self) -> int:
        return max(event.attempts for event in self.events)


@dataclass(frozen=True, slots=True)
class DeadEvent:
    """An event rule 2 made dead: what its dead-letter record carries."""

    id: int
    user_id: str
    source: str
    source_id: str
    kind: str
    payload: str
    session_id: str | None
    received_at: datetime | None
    occurred_at: datetime | None
    error: str | None


async def mark_dead(
    conn: psycopg.AsyncConnection[DictRow],
    owned: dict[PartitionKey, int],
    max_attempts: int,
    *,
    now: datetime | None = None,
) -> list[DeadEvent]:
    """Rule 2 for every owned partition, at ``now``: a lone last attempt a takeover handed
    back is not dead before its verdict's wait ends (:func:`forgive_lost_claims`). Returns
    the rows that became dead (for the DLQ)."""
    if not owned:
        return []
    params = {**owned_params(owned), "max_attempts": max_attempts, "now": now}
    cur = await conn.execute(Q.mark_exhausted_dead, params)
    return [DeadEvent(**{f.name: row[f.name] for f in fields(DeadEvent)}) for row in await cur.fetchall()]


async def alone_due(
    conn: psycopg.AsyncConnection[DictRow],
    owned: dict[PartitionKey, int],
    max_attempts: int,
    *,
    now: datetime | None = None,
) -> datetime | None:
    """When the first last attempt that must run alone may be claimed (``now`` if its backoff
    ended already); None if none waits."""
    if not owned:
        return None
    cur = await conn.execute(Q.alone_due, {**owned_params(owned), "max_attempts": max_attempts, "now": now})
    row = await cur.fetchone()
    return row["at"] if row else None


async def claim_alone(
    conn: psycopg.AsyncConnection[DictRow],
    owned: dict[PartitionKey, int],
    max_attempts: int,
    *,
    now: datetime | None = None,
) -> Claim | None:
    """Rule 3's lone last attempt, once its backoff ended at ``now``: one such row, for a
    runner with nothing else in flight."""
    if not owned:
        return None
    cur = await conn.execute(Q.claim_alone, {**owned_params(owned), "max_attempts": max_attempts, "now": now})
    claims = _claims(await cur.fetchall())
    return claims[0] if claims else None


async def claim(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    owned: dict[PartitionKey, int],
    busy: list[str],
    max_users: int,
    batch_max: int,
    window_s: float,
    max_attempts: int,
    cursor: str = "",
    now: datetime | None = None,
) -> tuple[list[Claim], str]:
    """Rules 3 and 4 for up to ``max_users`` users of the owned partitions. Returns the
    claims and the cursor for the next pass.

    Users are served round-robin in ``user_id`` order: first those after ``cursor``, then,
    if that did not fill the pass, from the start up to ``cursor``. Every waiting user gets
    a turn within one round, and a pass reads only the users it looks at, not the whole
    backlog. A row whose attempts are exhausted is never claimed: it waits for
    :func:`mark_dead`, which runs once per scan interval.

    Each range is one transaction: ``plan_claim_as_probes`` (index probes only), ``claim``
    chooses (and holds the epochs), ``claim_chosen`` writes the chosen rows by id (claims.sql
    says why).
    """
    if not owned or max_users <= 0:
        return [], cursor
    params = {
        **owned_params(owned),
        # Users with a run in flight here, as a JSON array (see claims.sql); pydantic-core's
        # encoder: with thousands of runs in flight, the stdlib's took 1% of a model-bound worker.
        "busy": pydantic_core.to_json(busy).decode(),
        "batch_max": batch_max,
        "window_s": window_s,
        "max_attempts": max_attempts,
        "now": now,
    }
    claims: list[Claim] = []
    # The users after the cursor; then, wrapping around, those up to where this pass started.
    ranges = [(cursor, None)] + ([("", cursor)] if cursor else [])
    for after, until in ranges:
        if len(claims) == max_users:
            break
        # Two statements, one transaction: the claim's FOR SHARE on the partitions holds the
        # epochs until the chosen rows are written (a takeover waits for the commit). Two round
        # trips (db.pipelined_transaction): BEGIN, the plan settings and the choice; then the
        # write and the COMMIT. A statement at a time took five, and a database across a
        # network adds each to every pass.
        written = None
        async with db.pipelined_transaction(conn):
            await conn.execute(Q.plan_claim_as_probes)
            cur = await conn.execute(
                Q.claim, {**params, "after": after, "until": until, "max_users": max_users - len(claims)}
            )
            chosen = await cur.fetchall()
            if chosen:
                cursor = chosen[0]["cursor"]
                homes = {row["user_id"]: row for row in chosen}
                # prepare=False: planned with these ids as a constant, every time (claims.sql).
                written = await conn.execute(
                    Q.claim_chosen,
                    {
                        "ids": [row["id"] for row in chosen],
                        "epochs": json.dumps({user: row["epoch"] for user, row in homes.items()}),
                    },
                    prepare=False,
                )
        if written is None:
            continue
        rows = await written.fetchall()
        for row in rows:
            home = homes[row["user_id"]]
            row["home_topic"], row["home_partition"] = home["topic"], home["partition"]
        claims += _claims(rows)
    return claims, cursor


def _claims(rows: list[dict[str, Any]]) -> list[Claim]:
    by_user: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_user[row["user_id"]].append(row)
    claims = []
    for user_id, rows in by_user.items():
        rows.sort(key=lambda r: r["id"])
        claims.append(
            Claim(
                user_id=user_id,
                home=PartitionKey(rows[0]["home_topic"], rows[0]["home_partition"]),
                epoch=rows[0]["claim_epoch"],
                events=[EventRow.of(r) for r in rows],
                transient_failures=max(r["transient_failures"] for r in rows),
                oldest_recorded_at=min(r["recorded_at"] for r in rows),
            )
        )
    return claims


async def claim_more(
    conn: psycopg.AsyncConnection[DictRow], claim: Claim, sources: Sequence[str], session_id: str | None = None
) -> list[EventRow]:
    """Fold: the user's fresh pending events of ``sources`` naming no session or naming
    ``session_id`` (the conversation in progress), claimed under the running claim's epoch."""
    return await _claim_under(conn, Q.claim_more, claim, {"sources": list(sources), "session_id": session_id})


async def claim_ids(
    conn: psycopg.AsyncConnection[DictRow], claim: Claim, ids: Sequence[int], max_attempts: int
) -> list[EventRow]:
    """A replay's adoption (:mod:`vigil.ledger.journal`): the user's pending events ``ids``,
    claimed under the running claim's epoch, except any this claim would bring to its last
    attempt (rule 3: a last attempt runs alone, never taken up by another event's replay).
    Returns those it claimed, in id order."""
    return await _claim_under(conn, Q.claim_ids, claim, {"ids": list(ids), "max_attempts": max_attempts})


async def due_alone(conn: psycopg.AsyncConnection[DictRow], event_id: int, max_attempts: int) -> bool:
    """Is ``event_id`` pending for rule 3's lone last attempt (lost with its worker before)?"""
    cur = await conn.execute(Q.due_alone, {"id": event_id, "max_attempts": max_attempts})
    return await cur.fetchone() is not None


async def claim_ids_alone(
    conn: psycopg.AsyncConnection[DictRow], claim: Claim, ids: Sequence[int], max_attempts: int
) -> list[EventRow]:
    """A batch replayed alone on its lead's last attempt (rule 3): the batch-mates ``ids``
    claimed under the lead's epoch without counting an attempt, and the lead's own attempt
    given back: a batch that lost its worker only in company has not crashed by itself yet.
    The caller marks the journal in the same transaction, so this happens once per batch.
    Returns the mates it claimed, in id order."""
    mates = await _claim_under(conn, Q.claim_ids_alone, claim, {"ids": list(ids), "max_attempts": max_attempts})
    home = {"topic": claim.home.topic, "partition": claim.home.partition, "epoch": claim.epoch}
    await conn.execute(Q.give_back_attempt, {**home, "ids": claim.event_ids})
    return mates


async def _claim_under(
    conn: psycopg.AsyncConnection[DictRow],
    query: str,
    claim: Claim,
    params: dict[str, list[str] | list[int] | str | int | None],
) -> list[EventRow]:
    """More of the user's events claimed under a running claim's home partition and epoch, in id order."""
    home = {"topic": claim.home.topic, "partition": claim.home.partition, "epoch": claim.epoch}
    cur = await conn.execute(query, {**home, "user_id": claim.user_id, **params})
    rows = sorted(await cur.fetchall(), key=lambda r: r["id"])
    return [EventRow.of(r) for r in rows]


async def backoff_ends(
    conn: psycopg.AsyncConnection[DictRow], keys: list[PartitionKey], *, now: datetime | None = None
) -> list[datetime]:
    """When pending events of ``keys`` that wait out a backoff past ``now`` become claimable
    (read at takeover)."""
    cur = await conn.execute(Q.backoff_ends, {**keys_params(sorted(keys)), "now": now})
    return [row["at"] for row in await cur.fetchall()]


async def forgive_lost_claims(
    conn: psycopg.AsyncConnection[DictRow],
    home: PartitionKey,
    epoch: int,
    ids: list[int],
    max_attempts: int,
    *,
    now: datetime | None = None,
) -> list[int]:
    """A worker that lost ``home`` while alive and cancelled the runs of ``ids`` (claimed
    under ``epoch``); a takeover came first and counted them lost with a crashed worker (rule
    1). It was no crash: the loss uncounted, a lone last attempt's count given back (its
    verdict of death waits for this) and a batch replayed alone unstamped, so the event's last
    attempt, or the batch's replay alone, runs again. Returns the ids forgiven; none once the
    verdict's wait ended (the event is dead) or a row was written since."""
    params = {
        "ids": ids,
        "epoch": epoch,
        "topic": home.topic,
        "partition": home.partition,
        "max_attempts": max_attempts,
        "now": now,
    }
    return [row["id"] for row in await (await conn.execute(Q.forgive_lost_claims, params)).fetchall()]


# A release that meets a finish committing one of its rows at the same moment (a run that
# returned just as it was cancelled: the finisher still commits it) is refused with "tuple
# to be locked was already moved to another partition" (the finish moved the row to
# events_finished). Run again, the statement skips that row (no longer running) and releases
# the rest; failed for good, the next owner's takeover hands them back as lost claims.
RELEASE_ATTEMPTS = 5


async def release_claim(conn: psycopg.AsyncConnection[DictRow], home: PartitionKey, epoch: int, ids: list[int]) -> int:
    """A graceful release of ``ids``, claimed under ``epoch`` for users of ``home`` (the
    events of any number of runs, and those folded into them): back to pending, the attempt
    not counted; fenced by the epoch. Returns how many moved. ``conn`` in autocommit mode:
    a refused attempt is retried as its own statement."""
    params = {"ids": ids, "epoch": epoch, "topic": home.topic, "partition": home.partition}
    for _ in range(RELEASE_ATTEMPTS - 1):
        try:
            return (await conn.execute(Q.release_claim, params)).rowcount
        except psycopg.errors.SerializationFailure:
            pass
    return (await conn.execute(Q.release_claim, params)).rowcount
