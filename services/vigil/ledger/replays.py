"""What-if replays (``queries/replays.sql``): the kept runs ``vigil runs replay`` reads.

A kept run is a finished run's journal (``VIGIL_RUN_JOURNAL_DAYS`` > 0) with the events its
start names. The replay itself runs in the command's process and writes nothing here
(:mod:`vigil.agent.whatif`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.events import EventRow
from vigil.ledger.queries import Q


@dataclass(frozen=True, slots=True)
class KeptRun:
    user_id: str
    run_key: str


def events(conn: psycopg.Connection[DictRow], user_id: str, ids: list[int]) -> list[EventRow]:
    """The user's events of these ids, oldest first (fewer when retention dropped some)."""
    return [EventRow.of(row) for row in conn.execute(Q.replays_events, {"user_id": user_id, "ids": ids})]


def sample(conn: psycopg.Connection[DictRow], *, since: datetime, profile: str | None, limit: int) -> list[KeptRun]:
    """Up to ``limit`` kept runs finished since ``since`` (of ``profile``, when given)."""
    params = {"since": since, "profile": profile, "limit": limit}
    return [KeptRun(**row) for row in conn.execute(Q.replays_sample, params)]


def memory(conn: psycopg.Connection[DictRow], user_id: str) -> dict[str, str]:
    """The user's memory files now, path -> content."""
    return {row["path"]: row["content"] for row in conn.execute(Q.replays_memory, {"user_id": user_id})}


@dataclass(frozen=True, slots=True)
class ReplayRow:
    """A recorded what-if replay, as the console lists it."""

    id: int
    run_key: str
    made_at: datetime
    made_by: str
    ran_with: str
    verdict: str
    messages_changed: bool


def record(
    conn: psycopg.Connection[DictRow],
    *,
    run_key: str,
    user_id: str,
    made_by: str,
    ran_with: str,
    verdict: str,
    messages_changed: bool,
    report: str,
) -> None:
    """One replay of a kept run (``report``: its JSON as the command prints it)."""
    params = {
        "run_key": run_key,
        "user_id": user_id,
        "made_by": made_by,
        "ran_with": ran_with,
        "verdict": verdict,
        "messages_changed": messages_changed,
        "report": report,
    }
    conn.execute(Q.replays_record, params)


def of_run(conn: psycopg.Connection[DictRow], run_key: str, limit: int = 50) -> list[ReplayRow]:
    """The replays of a run (``<user>:<first event id>``), newest first."""
    params = {"user_id": run_key.rpartition(":")[0], "run_key": run_key, "limit": limit}
    return [ReplayRow(**row) for row in conn.execute(Q.replays_of_run, params)]
