"""The ledger's time rules decided on the caller's clock (docs/architecture.md, "Time").

Every statement that decides by time takes ``now`` from the service's clock
(``coalesce(%(now)s, now())``), so a backoff, a hand-over deadline, a claim's batch window or
a task's deadline can be walked through on a :class:`ManualClock` moved by hours, with no sleep
and no rows backdated behind the rules' backs. Each test would fail if the statement read
the database's ``now()`` instead: the clock is hours away from it.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import psycopg
from psycopg.rows import dict_row

from support import query
from vigil.clock import ManualClock, utc
from vigil.ledger import claims as ledger_claims
from vigil.ledger import finish as ledger_finish
from vigil.ledger import partitions as ledger_partitions
from vigil.ledger import recovery as ledger_recovery
from vigil.ledger import tasks as ledger_tasks
from vigil.ledger.partitions import PartitionKey
from vigil.ledger.states import TaskStatus

HOME = PartitionKey("events", 0)
HOUR = 3600.0
# The clock starts a day ahead of the database's: a rule read on now() decides otherwise.
AHEAD_S = 24 * HOUR


def _clock(ledger: str) -> ManualClock:
    db_now: datetime = query(ledger, "SELECT now() AS t")[0]["t"]
    return ManualClock(db_now.timestamp() + AHEAD_S)


def _seed(ledger: str, users: list[str], status: str = "pending", epoch: int = 1) -> list[int]:
    query(ledger, "INSERT INTO partitions (topic, partition, epoch) VALUES ('events', 0, %s)", (epoch,))
    query(
        ledger,
        "INSERT INTO users (user_id, home_topic, home_partition) SELECT unnest(%s::text[]), 'events', 0",
        (users,),
    )
    rows = query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, status, attempts, claim_epoch)
           SELECT u, 'chat', u, 'chat.message', '{}', now(), %(status)s, %(attempts)s, %(epoch)s
           FROM unnest(%(users)s::text[]) AS u RETURNING id""",
        {
            "users": users,
            "status": status,
            "attempts": 1 if status == "running" else 0,
            "epoch": epoch if status == "running" else None,
        },
    )
    return [r["id"] for r in rows]


def _run(ledger: str, work):
    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await work(conn)

    return asyncio.run(go())


def _claim(conn, clock: ManualClock, window_s: float = 0.0):
    return ledger_claims.claim(
        conn,
        owned={HOME: 1},
        busy=[],
        max_users=10,
        batch_max=50,
        window_s=window_s,
        max_attempts=3,
        now=utc(clock.now()),
    )


def _next_attempt_s(ledger: str, clock: ManualClock) -> list[float]:
    """Each pending event's backoff end, in seconds after the clock's instant."""
    rows = query(ledger, "SELECT next_attempt_at FROM events WHERE status = 'pending' ORDER BY id")
    return [(r["next_attempt_at"] - utc(clock.now())).total_seconds() for r in rows]


def test_a_failed_attempt_backs_off_on_the_callers_clock_and_is_claimed_when_it_moves_past(ledger):
    """An hour's backoff from the clock's instant: not claimable 59 minutes on, claimable at
    61, with no sleep (the database's own clock is a day behind and never gets there)."""
    clock = _clock(ledger)
    (event,) = _seed(ledger, ["ann"])

    async def fail_then_claim(conn):
        (first,), _ = await _claim(conn, clock)
        cur = await ledger_finish.finish_failed(
            conn,
            ids=first.event_ids,
            epoch=1,
            run_id=0,
            error="boom",
            backoff_s=HOUR,
            transient=False,
            now=utc(clock.now()),
        )
        assert cur.rowcount == 1
        seen = []
        for minutes in (59, 2):
            clock.advance(minutes * 60)
            claims, _ = await _claim(conn, clock)
            seen.append([c.event_ids for c in claims])
        return seen

    assert _run(ledger, fail_then_claim) == [[], [[event]]]


def test_the_batch_window_is_measured_on_the_callers_clock(ledger):
    """A message recorded now waits out a 10 s batch window; the clock 10 s behind the
    database's sees it too young, a clock ahead sees it old enough."""
    _seed(ledger, ["bob"])
    db_now: datetime = query(ledger, "SELECT now() AS t")[0]["t"]
    behind = ManualClock(db_now.timestamp() - 10.0)
    assert _run(ledger, lambda conn: _claim(conn, behind, window_s=10.0))[0] == []
    ahead = ManualClock(db_now.timestamp() + 11.0)
    assert [c.user_id for c in _run(ledger, lambda conn: _claim(conn, ahead, window_s=10.0))[0]] == ["bob"]


def test_claims_handed_back_at_a_takeover_back_off_from_the_callers_clock(ledger):
    """hand_back_stale_claims: the backoff (base 60 s, cap 120 s, jitter 0.5 to 1) counts from
    the takeover's instant; backoff_ends reads it on the same clock."""
    clock = _clock(ledger)
    _seed(ledger, ["cat", "dan"], status="running")
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        epoch = ledger_partitions.take_over(conn, HOME, "next")
        handed = ledger_partitions.hand_back_stale_claims(
            conn,
            key=HOME,
            epoch=epoch,
            backoff_base_s=60.0,
            backoff_cap_s=120.0,
            max_attempts=3,
            verdict_s=30.0,
            now=utc(clock.now()),
        )
        conn.commit()
    assert len(handed) == 2
    assert all(30.0 <= s <= 60.0 for s in _next_attempt_s(ledger, clock)), _next_attempt_s(ledger, clock)
    ends = _run(ledger, lambda conn: ledger_claims.backoff_ends(conn, [HOME], now=utc(clock.now())))
    assert len(ends) == 2
    clock.advance(61.0)
    assert _run(ledger, lambda conn: ledger_claims.backoff_ends(conn, [HOME], now=utc(clock.now()))) == []


def test_orphaned_claims_released_back_off_from_the_callers_clock(ledger):
    clock = _clock(ledger)
    _seed(ledger, ["eve"], status="running")
    healed = _run(
        ledger,
        lambda conn: ledger_recovery.release_orphaned_claims(
            conn,
            owned={HOME: 1},
            busy=[],
            max_attempts=3,
            backoff_base_s=60.0,
            backoff_cap_s=120.0,
            now=utc(clock.now()),
        ),
    )
    assert [h.user_id for h in healed] == ["eve"]
    assert all(30.0 <= s <= 60.0 for s in _next_attempt_s(ledger, clock))


def test_a_hand_over_deadline_runs_on_the_callers_clock(ledger):
    """begin_handover sets the deadline from the clock; handover_left counts down on it and
    the hand-over is over once the clock passes it (the database's clock never would: it is
    a day behind)."""
    clock = _clock(ledger)
    _seed(ledger, ["fay"])
    _run(ledger, lambda conn: ledger_partitions.begin_handover(conn, {HOME: 1}, 30.0, now=utc(clock.now())))
    with psycopg.connect(ledger, row_factory=dict_row, autocommit=True) as conn:
        clock.advance(10.0)
        left = ledger_partitions.handover_left(conn, [HOME], now=utc(clock.now()))
        clock.advance(21.0)
        gone = ledger_partitions.handover_left(conn, [HOME], now=utc(clock.now()))
    assert left is not None and abs(left - 20.0) < 0.01, left
    assert gone is None


def _task(task_id: str, timeout_s: float) -> ledger_tasks.NewTaskRow:
    return ledger_tasks.NewTaskRow(
        id=task_id,
        user_id="gus",
        parent_run_key="gus:1",
        parent_task_id=None,
        session_id=None,
        depth=1,
        owner_chain=["gus", "gus:1"],
        instructions="x",
        tools=[],
        token_budget=1000,
        max_attempts=2,
        timeout_s=timeout_s,
        run_id=None,
    )


def test_task_deadlines_are_decided_on_the_callers_clock_and_leases_on_the_ledgers(ledger):
    """A task's deadline is set and judged on the caller's clock: claimable an hour on, never
    claimed again and timed out once the clock is past it, with no sleep. Its lease is not:
    heartbeats are stamped and their age judged on the ledger's clock (docs/tasks.md, "One
    clock per row"), so hours on the caller's clock take no lease back."""
    clock = _clock(ledger)

    async def life(conn):
        now = lambda: utc(clock.now())  # noqa: E731
        await ledger_tasks.create(conn, _task("tsk_clock", timeout_s=2 * HOUR), now=now())
        (held,) = await ledger_tasks.claim(conn, "h1", 1, now=now())
        clock.advance(HOUR)
        assert await ledger_tasks.heartbeat(conn, held.id, held.lease_epoch) is False
        clock.advance(HOUR - 1.0)
        kept = await ledger_tasks.reap(conn, 60.0, now=now())
        gauge = await ledger_tasks.gauges(conn)
        clock.advance(2.0)
        late = await ledger_tasks.claim(conn, "h2", 1, now=now())
        timed_out = await ledger_tasks.reap(conn, 60.0, now=now())
        return kept, gauge, late, timed_out

    kept, gauge, late, timed_out = _run(ledger, life)
    assert kept == [] and gauge.heartbeat_age_s < 60.0  # hours on the caller's clock: still held
    assert late == []  # past its deadline: never claimed again
    assert [r.status for r in timed_out] == [TaskStatus.TIMED_OUT]
