"""Events (``queries/events.sql``): recording a polled batch, and what operators read and
write (`vigil inbox`, `vigil dead`, shared with the console). The claim rules are in
:mod:`vigil.ledger.claims`, the finish in :mod:`vigil.ledger.finish`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import set_json_dumps

from vigil.ledger import audit
from vigil.ledger.partitions import PartitionKey, keys_params
from vigil.ledger.queries import Q

COMMIT = "COMMIT"  # record_batch's, sent in its pipeline


@dataclass(frozen=True, slots=True)
class EventRow:
    """A claimed event as the agent sees it."""

    id: int
    user_id: str
    source: str
    source_id: str
    kind: str
    payload: str
    session_id: str | None
    received_at: datetime
    attempts: int

    def payload_json(self) -> Any:
        try:
            return json.loads(self.payload)
        except ValueError:
            return self.payload

    @classmethod
    def of(cls, row: dict[str, Any]) -> EventRow:
        return cls(
            id=row["id"],
            user_id=row["user_id"],
            source=row["source"],
            source_id=row["source_id"],
            kind=row["kind"],
            payload=row["payload"],
            session_id=row["session_id"],
            received_at=row["received_at"],
            attempts=row["attempts"],
        )


# -- recording ---------------------------------------------------------------------------

# Column types of record_copy, in its order (binary COPY needs them named).
STAGING_TYPES = [
    "int4",
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "jsonb",
    "timestamptz",
    "timestamptz",
    "text",
    "int4",
    "int8",
]
USER_COLUMN = 1  # a staging row's user_id (after n)
PARTITION_COLUMN = -2  # a staging row's partition (..., topic, partition, offset)


def _headers_json(headers: dict[str, str]) -> str:
    # Most events carry no headers; json.dumps costs several microseconds even for {},
    # more than the rest of the row's COPY formatting.
    return json.dumps(headers) if headers else "{}"


def prepare_record_connection(conn: psycopg.Connection[Any]) -> None:
    """Make ``conn`` ready for :func:`copy_rows`: its staging table, and its JSON dumps."""
    set_json_dumps(_headers_json, context=conn)
    conn.execute(Q.record_staging)
    conn.commit()


def copy_rows(cur: psycopg.Cursor[Any], rows: Iterable[tuple[Any, ...]]) -> None:
    """Binary-COPY staging rows (``STAGING_TYPES`` order, headers a dict) into the staging table."""
    with cur.copy(Q.record_copy) as copy:
        copy.set_types(STAGING_TYPES)
        for row in rows:
            copy.write_row(row)


def record_params(unknown_users: list[str], next_offsets: dict[PartitionKey, int]) -> dict[str, Any]:
    """record_events' parameters: the users to give a home partition, each partition's next offset."""
    keys = sorted(next_offsets)
    return {"unknown_users": unknown_users, **keys_params(keys), "next_offsets": [next_offsets[k] for k in keys]}


def record_batch(
    conn: psycopg.Connection[DictRow],
    rows: list[tuple[Any, ...]],
    unknown_users: list[str],
    next_offsets: dict[PartitionKey, int],
) -> int:
    """The worker's record step, one transaction: COPY ``rows`` (staging order) in, then one
    statement (``record_events``) that moves the new ones into the queue, gives new users
    their home partition (``unknown_users`` only) and moves the ledger's consumer positions
    past the batch, so positions and the events they cover commit or vanish together. A
    batch of undecodable messages only moves the positions. Returns how many were new.

    Four round trips: BEGIN, the COPY's two (its start, its data), then the statement and
    the COMMIT in one pipeline. Each one, on the recorder thread, also waits for the
    interpreter lock, and with the ledger across a network each is on every event's way in.
    The COMMIT is a statement of the pipeline, not ``conn.commit()``: that syncs once for
    itself and once more as the pipeline closes (five round trips: ``tests/test_record_step.py``)."""
    try:
        with conn.cursor() as cur:
            if rows:
                copy_rows(cur, rows)
            with conn.pipeline():
                cur.execute(Q.record_events, record_params(unknown_users, next_offsets))
                conn.execute(COMMIT)  # its own cursor: ``cur`` keeps the statement's row
            row = cur.fetchone()
    except BaseException:
        if not conn.closed and not conn.broken:
            conn.rollback()
        raise
    assert row is not None
    recorded: int = row["recorded"]
    return recorded


# -- operators ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeadEventRow:
    """`vigil dead list`'s row."""

    id: int
    user_id: str
    source: str
    source_id: str
    kind: str
    attempts: int
    error: str | None
    finished_at: datetime
    received_at: datetime


@dataclass(frozen=True, slots=True)
class InboxRow:
    """`vigil inbox`'s row: one of a user's events and its state."""

    id: int
    source: str
    source_id: str
    kind: str
    status: str
    attempts: int
    lost_claims: int
    claim_epoch: int | None
    error: str | None
    received_at: datetime
    recorded_at: datetime
    finished_at: datetime | None
    run_id: int | None


def dead_list(conn: psycopg.Connection[DictRow], limit: int) -> list[DeadEventRow]:
    """Dead events, newest first."""
    rows = conn.execute(Q.dead_list, {"limit": limit}).fetchall()
    return [DeadEventRow(**{f.name: row[f.name] for f in fields(DeadEventRow)}) for row in rows]


def inbox(conn: psycopg.Connection[DictRow], user_id: str, limit: int) -> list[InboxRow]:
    """A user's events and their states, newest first."""
    rows = conn.execute(Q.inbox, {"user_id": user_id, "limit": limit}).fetchall()
    return [InboxRow(**{f.name: row[f.name] for f in fields(InboxRow)}) for row in rows]


@dataclass(frozen=True, slots=True)
class PendingAge:
    age_s: float  # of the oldest pending event; 0 when none waits
    pending: int


async def oldest_pending(conn: psycopg.AsyncConnection[DictRow]) -> PendingAge:
    """The age of the oldest pending event and how many are pending (one scan answers both)."""
    row = await (await conn.execute(Q.oldest_pending_age)).fetchone()
    assert row is not None
    return PendingAge(row["age"], row["pending"])


@dataclass(frozen=True)
class Retried:
    retried: list[int]  # sent back to pending
    missing: list[int]  # asked for but not dead (unknown, or someone retried them already): left alone


def retry_dead_events(conn: psycopg.Connection[DictRow], ids: list[int], actor: str) -> Retried:
    """Send dead events back to pending with their attempts reset, and audit it, in one transaction.

    The update only moves rows that are still dead, so two operators retrying the same event
    retry it once; the audit row names who asked (``actor``: a login name, or a console
    token's name and id) and what was actually retried. A crash before the commit leaves nothing.
    """
    with conn.transaction():
        rows = conn.execute(Q.dead_retry, {"ids": list(ids), "actor": actor}).fetchall()
        done = [r["id"] for r in rows]
        audit.record(conn, actor=actor, action="dead.retry", detail={"requested": list(ids), "retried": done})
    return Retried(retried=sorted(done), missing=sorted(set(ids) - set(done)))
