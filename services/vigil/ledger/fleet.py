"""One fleet toward the model (``queries/fleet.sql``): a bound on concurrent model calls
across every worker, and a back-off they share.

The rules:

1. **Slots.** ``VIGIL_MODEL_FLEET_CONCURRENCY`` rows in ``model_slots``. A model call takes a
   free one (:func:`take_slot`) for at most its lease, the model timeout and a margin, and gives
   it back when it ends (:func:`give_back`). A worker that dies mid-call holds its slot only
   until the lease ends. ``SKIP LOCKED``: two workers taking at once never wait on each other.
2. **The shared back-off.** A 429 or 529 moves ``model_backoff.until`` forward
   (:func:`slow_down`; never back, so the longest pause any worker was told wins); every worker
   reads it (:func:`paused_until`) before its next call and waits until then.

Both are decided on the caller's clock (``now``), the database's when not given.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.ledger.queries import Q

Conn = psycopg.AsyncConnection[DictRow]


@dataclass(frozen=True, slots=True)
class Pause:
    """The shared back-off in force: until when, why, and which worker was told."""

    until: datetime
    reason: str
    set_by: str


async def make_slots(conn: Conn, *, size: int, now: datetime | None = None) -> None:
    """Slots ``0..size-1`` exist, and those past ``size`` go once free (a worker's start)."""
    async with conn.transaction():
        await conn.execute(Q.fleet_slots_make, {"size": size})
        await conn.execute(Q.fleet_slots_trim, {"size": size, "now": now})


async def take_slot(conn: Conn, *, size: int, holder: str, lease_s: float, now: datetime | None = None) -> int | None:
    """A free slot leased to ``holder`` for ``lease_s`` seconds, or None when all are held."""
    cur = await conn.execute(Q.fleet_slot_take, {"size": size, "holder": holder, "lease_s": lease_s, "now": now})
    row = await cur.fetchone()
    return None if row is None else int(row["slot"])


async def give_back(conn: Conn, *, slot: int, holder: str) -> None:
    """The call holding ``slot`` ended: the slot is free at once."""
    await conn.execute(Q.fleet_slot_give_back, {"slot": slot, "holder": holder})


async def slots_held(conn: Conn, *, now: datetime | None = None) -> int:
    cur = await conn.execute(Q.fleet_slots_held, {"now": now})
    row = await cur.fetchone()
    return 0 if row is None else int(row["held"])


async def slow_down(
    conn: Conn,
    *,
    provider: str,
    until: datetime,
    reason: str,
    set_by: str,
    now: datetime | None = None,
) -> None:
    """The provider said slow down: every worker waits until ``until`` (or later, if another
    worker was told a longer pause)."""
    await conn.execute(
        Q.fleet_backoff_set, {"provider": provider, "until": until, "reason": reason, "set_by": set_by, "now": now}
    )


async def paused_until(conn: Conn, *, provider: str, now: datetime | None = None) -> Pause | None:
    """The shared back-off in force now, or None."""
    cur = await conn.execute(Q.fleet_backoff_get, {"provider": provider, "now": now})
    row = await cur.fetchone()
    if row is None:
        return None
    return Pause(row["until"], row["reason"], row["set_by"])
