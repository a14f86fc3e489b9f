"""The claim pass and the group finish against a real ledger, without processes: who gets a
turn, and that a pass costs what it claims, not what waits.

The cost tests read PostgreSQL's own account of the statement (EXPLAIN ANALYZE): no plan
node may touch more rows than a small multiple of the work asked for. Both statements once
read every waiting user (claim) or matched every running row against every run (finish),
which made the worker slower the further it fell behind.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from datetime import UTC, datetime

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg.rows import dict_row

from support import auto_explain, explaining, query
from vigil.agent.base import EventRow, OutMessage, RunResult
from vigil.clock import ManualClock, utc
from vigil.ledger.claims import Claim, DeadEvent, alone_due, claim, claim_alone, mark_dead
from vigil.ledger.finish import finish_runs_params
from vigil.ledger.partitions import PartitionKey
from vigil.ledger.queries import Q
from vigil.ledger.states import RunOutcome
from vigil.worker.fencing import take_over, wait_for_handover
from vigil.worker.finish import Finished, run_record

HOME = PartitionKey("events", 0)
OWNED = {HOME: 1}


def seed_pending(ledger: str, users: int, per_user: int = 1, status: str = "pending") -> list[str]:
    """``users`` users at home on HOME with ``per_user`` events each, the lower-numbered
    users' events older (so an oldest-first claim would always prefer them)."""
    names = [f"u{i:05d}" for i in range(users)]
    query(ledger, "INSERT INTO partitions (topic, partition, epoch) VALUES ('events', 0, 1) ON CONFLICT DO NOTHING")
    query(
        ledger,
        "INSERT INTO users (user_id, home_topic, home_partition) SELECT unnest(%s::text[]), 'events', 0",
        (names,),
    )
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, recorded_at, status, attempts,
                              claim_epoch)
           SELECT u, 'chat', u || '-' || k, 'chat.message', '{}', now(),
                  now() - interval '1 hour' + n * interval '1 ms',
                  %(status)s, %(attempts)s, %(epoch)s
           FROM unnest(%(users)s::text[]) WITH ORDINALITY AS x(u, n), generate_series(1, %(per_user)s) AS k""",
        {
            "users": names,
            "per_user": per_user,
            "status": status,
            "attempts": 1 if status == "running" else 0,
            "epoch": 1 if status == "running" else None,
        },
    )
    query(ledger, "ANALYZE events")
    return names


def claim_pass(ledger: str, max_users: int, cursor: str, busy: list[str] | None = None):
    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await claim(
                conn,
                owned=OWNED,
                busy=busy or [],
                max_users=max_users,
                batch_max=50,
                window_s=0.0,
                max_attempts=3,
                cursor=cursor,
            )

    return asyncio.run(go())


def hand_back(ledger: str) -> None:
    """As if every claimed run failed transiently: its events pending again, attempt given back."""
    query(ledger, "UPDATE events SET status = 'pending', claim_epoch = NULL, attempts = 0 WHERE status = 'running'")


def test_every_waiting_user_gets_a_turn_before_anyone_gets_two(ledger):
    users = seed_pending(ledger, 25)
    cursor, served = "", []
    for _ in range(3):
        claims, cursor = claim_pass(ledger, 10, cursor)
        served.append([c.user_id for c in claims])
        hand_back(ledger)
    # Round-robin in user order, wrapping around: the oldest (lowest) users do not win every pass.
    assert sorted(served[0]) == users[0:10]
    assert sorted(served[1]) == users[10:20]
    assert sorted(served[2]) == sorted(users[20:25] + users[0:5])
    assert cursor == users[4]


def test_busy_and_running_users_are_skipped_not_counted(ledger):
    users = seed_pending(ledger, 6)
    claims, _ = claim_pass(ledger, 3, "", busy=[users[0]])
    assert sorted(c.user_id for c in claims) == users[1:4]
    # Rule 4 from the ledger's side: users 1-3 are running now, so the next pass takes 4, 5, 0.
    claims, _ = claim_pass(ledger, 3, "")
    assert sorted(c.user_id for c in claims) == [users[0], users[4], users[5]]


def _nodes(plan: dict) -> list[dict]:
    """Every node of an EXPLAIN (FORMAT JSON) plan."""
    return [plan] + [n for child in plan.get("Plans", []) for n in _nodes(child)]


def _max_rows_per_node(plan: dict) -> int:
    return max(int(n.get("Actual Rows", 0) * n.get("Actual Loops", 1)) for n in _nodes(plan))


def _explain(ledger: str, sql: str, params: dict) -> int:
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()["QUERY PLAN"][0]["Plan"]
        conn.rollback()
    return _max_rows_per_node(plan)


def crash_and_take_over(ledger: str) -> int:
    """The worker holding HOME died: the next one takes over (epoch + 1) and hands back."""
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        epochs = take_over(conn, [HOME], "next-worker", 0.0, 0.0, 3)
    query(ledger, "UPDATE events SET next_attempt_at = NULL")  # backoffs are not the point here
    return epochs[HOME]


def handover(ledger: str, epoch: int, seconds: float, end: bool = False) -> list[PartitionKey]:
    """The holder of HOME at ``epoch`` leaves a hand-over deadline (``end``: clears it)."""
    from vigil.ledger import partitions as ledger_partitions

    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            if end:
                return await ledger_partitions.end_handover(conn, {HOME: epoch})
            return await ledger_partitions.begin_handover(conn, {HOME: epoch}, seconds)

    return asyncio.run(go())


def timed_take_over(ledger: str) -> tuple[int, float]:
    began = time.monotonic()
    epoch = crash_and_take_over(ledger)
    return epoch, time.monotonic() - began


def test_a_takeover_waits_for_the_hand_over_until_it_ends(ledger):
    """Rule 4: a revoking holder's runs finish under its epoch while its hand-over lasts; the
    next takeover bumps the epoch only once the holder ends it, not at its deadline."""
    seed_pending(ledger, 1)
    assert handover(ledger, 1, 30.0) == [HOME]
    timer = threading.Timer(0.8, lambda: handover(ledger, 1, 0, end=True))
    timer.start()
    try:
        epoch, waited = timed_take_over(ledger)
    finally:
        timer.join()
    assert epoch == 2 and 0.7 < waited < 5.0
    assert query(ledger, "SELECT handover_until FROM partitions") == [{"handover_until": None}]


def test_a_hand_over_left_by_a_dead_holder_ends_at_its_deadline(ledger):
    """The holder died mid hand-over (nobody ends it): once the takeover's clock is past the
    deadline (half an hour, no sleep) it goes ahead, and hands back the dead holder's claims
    as ever, with backoffs counted from that clock. A minute before it, the takeover waits."""
    seed_pending(ledger, 1)
    claim_pass_at(ledger, 1, 10)
    handover(ledger, 1, 1800.0)
    clock = ManualClock(time.time() + 1740.0)
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        assert wait_for_handover(conn, [HOME], 0.2, clock=clock) >= 0.2  # still handed over
        clock.advance(61.0)
        began = time.monotonic()
        epochs = take_over(conn, [HOME], "next-worker", 60.0, 60.0, 3, clock=clock)
        waited = time.monotonic() - began
    assert epochs == {HOME: 2} and waited < 1.0
    (row,) = query(ledger, "SELECT status, lost_claims, next_attempt_at FROM events")
    assert (row["status"], row["lost_claims"]) == ("pending", 1)
    assert 30.0 <= (row["next_attempt_at"] - utc(clock.now())).total_seconds() <= 60.0


def test_a_stale_holder_cannot_start_a_hand_over(ledger):
    """Rule 4 is fenced like every other write: a holder whose epoch moved on sets no deadline,
    and the next takeover does not wait for it."""
    seed_pending(ledger, 1)
    crash_and_take_over(ledger)  # epoch 2: the holder at epoch 1 lost the partition
    assert handover(ledger, 1, 30.0) == []
    assert timed_take_over(ledger)[1] < 1.0


class DeferredTakeover:
    """A worker's consumer at an assignment of HOME during a hand-over (its takeover deferred
    to a thread, ``Rebalancer.take_over_later``), against the real ledger; the run loop
    only records what it is told to claim for."""

    def __init__(self, ledger: str, monkeypatch):
        from vigil.settings import load
        from vigil.worker import metrics
        from vigil.worker.consumer import ConsumerLoop
        from vigil.worker.settings import WorkerSettings

        monkeypatch.setenv("VIGIL_DATABASE_URL", ledger)
        self.assigned: list[dict] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        assigned = self.assigned

        class Claimer:
            async def assign(self, epochs):
                assigned.append(epochs)

        class RunLoop:
            claimer = Claimer()

        settings = load(WorkerSettings, instance_id="next-worker")
        self.consumer = ConsumerLoop(settings, RunLoop(), self.loop, None, threading.Event())
        self.consumer.rebalance.taking_over.add(HOME)
        metrics.AWAITING_TAKEOVER.set(1)  # as on_assign sets it
        self.thread = threading.Thread(target=self.consumer.rebalance.take_over_later, args=([HOME],), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.consumer.stopping.set()
        self.thread.join(5)
        self.loop.call_soon_threadsafe(self.loop.stop)


def holder(ledger: str) -> dict:
    return query(ledger, "SELECT epoch, holder FROM partitions")[0]


def test_a_deferred_takeover_waits_for_the_hand_over_then_lets_the_run_loop_claim(ledger, monkeypatch):
    """The next owner records a partition being handed over at once and takes it over later:
    its takeover thread leaves the epoch alone while the hand-over lasts, then bumps it and
    hands the new epoch to the run loop."""
    seed_pending(ledger, 1)
    handover(ledger, 1, 30.0)
    deferred = DeferredTakeover(ledger, monkeypatch)
    try:
        time.sleep(0.6)
        assert deferred.thread.is_alive() and deferred.assigned == []
        assert holder(ledger)["epoch"] == 1
        assert REGISTRY.get_sample_value("vigil_partitions_awaiting_takeover") == 1
        handover(ledger, 1, 0, end=True)
        deferred.thread.join(5)
        assert not deferred.thread.is_alive()
        assert deferred.assigned == [{HOME: 2}]
        assert REGISTRY.get_sample_value("vigil_partitions_awaiting_takeover") == 0
        assert holder(ledger) == {"epoch": 2, "holder": "next-worker"}
        assert not deferred.consumer.rebalance.taking_over
    finally:
        deferred.close()


def test_a_partition_revoked_before_its_deferred_takeover_is_never_taken_over(ledger, monkeypatch):
    """Revoked (or lost) while its takeover waits for the hand-over, the partition is someone
    else's next: the thread gives up, and never bumps the epoch after it left."""
    seed_pending(ledger, 1)
    handover(ledger, 1, 30.0)
    before = holder(ledger)
    deferred = DeferredTakeover(ledger, monkeypatch)
    try:
        time.sleep(0.3)
        deferred.consumer.rebalance.forget_takeovers([HOME])  # what on_revoke and on_lost do first
        deferred.thread.join(2)
        assert not deferred.thread.is_alive(), "the takeover went on waiting for a partition it lost"
        handover(ledger, 1, 0, end=True)
        time.sleep(0.3)
        assert deferred.assigned == [] and holder(ledger) == before
        assert REGISTRY.get_sample_value("vigil_partitions_awaiting_takeover") == 0
    finally:
        deferred.close()


def run_alone(ledger: str, epoch: int):
    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            owned = {HOME: epoch}
            return await alone_due(conn, owned, 3), await claim_alone(conn, owned, 3)

    return asyncio.run(go())


def test_only_an_event_that_ran_alone_can_die_of_a_crash(ledger):
    """Claim rule 3: a crash takes every run in flight down. Three crashes caused by one
    poison event once killed every event that happened to run beside it all three times."""
    users = seed_pending(ledger, 3)
    epoch = 1
    for crash in (1, 2):  # two claims in company, each lost with the worker
        claims, _ = claim_pass_at(ledger, epoch, 10)
        assert sorted(c.user_id for c in claims) == users, f"crash {crash}: everyone was claimed together"
        epoch = crash_and_take_over(ledger)
    rows = query(ledger, "SELECT status, attempts, lost_claims FROM events ORDER BY user_id")
    assert [(r["status"], r["attempts"], r["lost_claims"]) for r in rows] == [("pending", 2, 2)] * 3
    # Their last attempts are not for the round robin: each runs alone, one at a time.
    assert claim_pass_at(ledger, epoch, 10)[0] == []
    due, lone = run_alone(ledger, epoch)
    assert due is not None and lone is not None and lone.user_id == users[0] and lone.attempt == 3
    # The worker dies again with this one alone: now the crash is its own, and it is dead.
    epoch = crash_and_take_over(ledger)
    dead = mark_dead_at(ledger, epoch)
    assert [r.user_id for r in dead] == [users[0]]
    assert "dead after 3 attempts" in dead[0].error
    # The others still get their lone last attempts.
    due, lone = run_alone(ledger, epoch)
    assert lone is not None and lone.user_id == users[1]


def test_a_last_attempt_lost_in_company_is_not_counted(ledger):
    """Events on their last attempt after two failures of their own, claimed together and
    lost with their worker: nobody dies, and each gets its last attempt alone."""
    users = seed_pending(ledger, 3)
    query(ledger, "UPDATE events SET attempts = 2")
    claims, _ = claim_pass_at(ledger, 1, 10)
    assert sorted(c.user_id for c in claims) == users and {c.attempt for c in claims} == {3}
    epoch = crash_and_take_over(ledger)
    assert mark_dead_at(ledger, epoch) == []
    rows = query(ledger, "SELECT status, attempts, lost_claims FROM events ORDER BY user_id")
    assert [(r["status"], r["attempts"], r["lost_claims"]) for r in rows] == [("pending", 2, 1)] * 3
    assert claim_pass_at(ledger, epoch, 10)[0] == []
    assert run_alone(ledger, epoch)[1].user_id == users[0]


def test_a_lone_attempt_keeps_its_users_order(ledger):
    """Later events of the user wait behind the lone attempt; other users do not."""
    seed_pending(ledger, 2)
    query(ledger, """UPDATE events SET attempts = 2, lost_claims = 1 WHERE user_id = 'u00000'""")
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, received_at, recorded_at)
                     VALUES ('u00000', 'chat', 'later', 'chat.message', now(), now() - interval '1 minute')""",
    )
    claims, _ = claim_pass_at(ledger, 1, 10)
    assert [c.user_id for c in claims] == ["u00001"]
    due, lone = run_alone(ledger, 1)
    assert lone is not None and [e.source_id for e in lone.events] == ["u00000-1"]


def claim_pass_at(ledger: str, epoch: int, max_users: int):
    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await claim(
                conn,
                owned={HOME: epoch},
                busy=[],
                max_users=max_users,
                batch_max=50,
                window_s=0.0,
                max_attempts=3,
                cursor="",
            )

    return asyncio.run(go())


def mark_dead_at(ledger: str, epoch: int) -> list[DeadEvent]:
    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await mark_dead(conn, {HOME: epoch}, 3)

    return asyncio.run(go())


def test_a_claim_pass_reads_what_it_claims_not_the_backlog(ledger):
    seed_pending(ledger, 3000)
    params = {
        "topics": ["events"],
        "partitions": [0],
        "epochs": [1],
        "busy": "[]",  # a JSON array (claims.sql)
        "max_users": 10,
        "batch_max": 50,
        "window_s": 0.0,
        "max_attempts": 3,
        "after": "u01000",
        "until": None,
        "now": datetime.now(UTC),  # what the worker passes: its clock
    }
    # 10 users claimed out of 3,000 waiting: no step of the plan may read hundreds of them.
    assert _explain(ledger, Q.claim, params) <= 50


def test_busy_users_are_looked_up_in_a_hash_not_compared_one_by_one(ledger):
    """The users with a run in flight here (up to VIGIL_RUN_CONCURRENCY of them) are skipped
    through a hash table built once per pass. As ``<> ALL(array)`` every waiting user was
    compared with every busy one: 16 of a 25 ms pass at 1,000 waiting and 500 busy."""
    users = seed_pending(ledger, 200)
    params = {
        "topics": ["events"],
        "partitions": [0],
        "epochs": [1],
        "busy": json.dumps(users[::2]),
        "max_users": 200,
        "batch_max": 50,
        "window_s": 0.0,
        "max_attempts": 3,
        "after": "",
        "until": None,
        "now": datetime.now(UTC),  # what the worker passes: its clock
    }
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + Q.claim, params).fetchall())
        assert "hashed SubPlan" in plan, plan
        heal = {
            "topics": ["events"],
            "partitions": [0],
            "epochs": [1],
            "busy": json.dumps(users),
            "max_attempts": 3,
            "backoff_base": 1.0,
            "backoff_cap": 60.0,
            "now": datetime.now(UTC),
        }
        plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN " + Q.release_orphaned_claims, heal).fetchall())
        assert "hashed SubPlan" in plan, plan
    claims, _ = claim_pass(ledger, 200, "", busy=users[::2])
    assert sorted(c.user_id for c in claims) == users[1::2]


def test_a_claim_pass_stays_cheap_when_the_statistics_say_nothing_waits(ledger):
    """A queue table's statistics are usually stale: ANALYZE ran when nothing was pending.
    With such statistics the planner once scanned every pending row and re-ran the whole
    claim for each of them (51 s for one pass in the two-worker benchmark)."""
    seed_pending(ledger, 3000, per_user=2, status="running")  # ANALYZEd: no pending rows at all
    # keep them stale (the queue part of events: events_live)
    query(ledger, "ALTER TABLE events_live SET (autovacuum_enabled = false)")
    query(ledger, "UPDATE events SET status = 'pending', claim_epoch = NULL, attempts = 0")
    params = {
        "topics": ["events"],
        "partitions": [0],
        "epochs": [1],
        "busy": "[]",  # a JSON array (claims.sql)
        "max_users": 10,
        "batch_max": 50,
        "window_s": 0.0,
        "max_attempts": 3,
        "after": "u01000",
        "until": None,
        "now": datetime.now(UTC),  # what the worker passes: its clock
    }
    assert _explain(ledger, Q.claim, params) <= 100
    query(ledger, "UPDATE events SET attempts = 3 WHERE user_id = 'u00007'")
    assert (
        _explain(
            ledger,
            Q.mark_exhausted_dead,
            {"topics": ["events"], "partitions": [0], "epochs": [1], "max_attempts": 3, "now": None},
        )
        <= 100
    )


def bloat_and_analyze_nearly_empty(ledger: str, users: int, per_user: int) -> None:
    """The statistics of a queue analyzed between bursts: ``users`` x ``per_user`` rows came
    and went, ANALYZE saw the few left (running ones), VACUUM freed the pages without
    giving them back; then the next burst, as many rows, all pending and never analyzed.
    The planner believes the live queue holds 4 rows in 300 pages."""
    seed_pending(ledger, users, per_user=per_user)
    query(ledger, "ALTER TABLE events_live SET (autovacuum_enabled = false)")
    query(ledger, "DELETE FROM events WHERE id < (SELECT max(id) - 3 FROM events)")
    query(ledger, "UPDATE events SET status = 'running', claim_epoch = 1, attempts = 1")
    query(ledger, "ANALYZE events_live")
    query(ledger, "VACUUM events_live")
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, recorded_at, status, attempts)
           SELECT u, 'chat', u || '-again-' || k, 'chat.message', '{}', now(), now() - interval '1 hour', 'pending', 0
           FROM unnest(%(users)s::text[]) AS u, generate_series(1, %(per_user)s) AS k""",
        {"users": [f"u{i:05d}" for i in range(users)], "per_user": per_user},
    )
    query(ledger, "UPDATE events SET status = 'pending', claim_epoch = NULL, attempts = 0 WHERE status = 'running'")


def explained(ledger: str, plan_cache_mode: str, work):
    """``await work(conn)`` on a connection whose every statement's executed plan is kept
    (auto_explain): returns what ``work`` returned and the plans."""
    plans: list[dict] = []
    settings, keep = auto_explain(plan_cache_mode, plans)

    async def go():
        async with await psycopg.AsyncConnection.connect(
            explaining(ledger), autocommit=True, row_factory=dict_row
        ) as conn:
            conn.add_notice_handler(keep)
            for setting in settings:
                await conn.execute(setting)
            return await work(conn)

    return asyncio.run(go()), plans


def _max_rows_read_per_node(plan: dict) -> int:
    """Rows a node handled: returned and filtered out, over all its loops."""
    return max(
        int(
            (n.get("Actual Rows", 0) + n.get("Rows Removed by Filter", 0) + n.get("Rows Removed by Join Filter", 0))
            * n.get("Actual Loops", 1)
        )
        for n in _nodes(plan)
    )


def assert_linear(plans: list[dict], live: int, what: str) -> None:
    """No step read more than the live queue twice over, and none compared rows one by one
    with a parameter array (a generic plan's ``= ANY($n)`` as a filter)."""
    assert plans, what
    for plan in plans:
        text = plan["Query Text"].split("\n")[0]
        assert _max_rows_read_per_node(plan["Plan"]) <= 2 * live, (what, text)
        filters = [n.get("Filter", "") for n in _nodes(plan["Plan"])]
        row_by_row = [f for f in filters if re.search(r"= ANY \(\(\$\d+\)", f)]
        assert not row_by_row, (what, text, row_by_row)


def test_claim_and_finish_stay_linear_when_the_queue_was_analyzed_nearly_empty(ledger):
    """Statistics taken between two bursts (a handful of rows in a bloated table) once made the
    claim's write a nested loop that compared every chosen row with every live row (100
    million comparisons, 4.4 s for 5,000 rows), and the group finish a walk of every running
    row comparing each with every id of the group (5.6 s): passes of seconds in the e2e and
    two-worker benchmarks. Whatever the plan, custom or generic (prepared statements switch
    to one), no step may read more than the live queue once over, nor compare row by row."""
    bloat_and_analyze_nearly_empty(ledger, 4000, 5)
    live = 20_000
    for mode in ("force_custom_plan", "force_generic_plan"):
        (claims, _), plans = explained(
            ledger,
            mode,
            lambda conn: claim(
                conn, owned=OWNED, busy=[], max_users=1000, batch_max=50, window_s=0.0, max_attempts=3, cursor="u02000"
            ),
        )
        assert len(claims) == 1000 and sum(len(c.events) for c in claims) == 5000, mode
        assert_linear(plans, live, f"claim, {mode}")
        # The claim reads the queue by index probes only: a churned queue's statistics once
        # made a skip-scan step a bitmap scan of every pending row after the user, and the
        # write a sequential scan of the whole bloated queue (queries/claims.sql).
        scans = {(n["Node Type"], n.get("Relation Name")) for plan in plans for n in _nodes(plan["Plan"])}
        assert not {s for s in scans if s[1] == "events_live" and s[0] in ("Seq Scan", "Bitmap Heap Scan")}, scans
        finished = [
            run_record(
                Finished(
                    c,
                    datetime(2020, 1, 1, tzinfo=UTC),
                    result=RunResult(RunOutcome.MESSAGE, messages=[OutMessage("hi")]),
                )
            )
            for c in claims[:400]
        ]

        async def finish(conn, runs=finished):
            written = []
            # prepare=True: the statement as the worker sends it after its first uses; rolled
            # back, so the next mode finds the same queue.
            async with conn.transaction():
                cur = await conn.execute(Q.finish_runs, finish_runs_params(runs, "test-worker"), prepare=True)
                written = await cur.fetchall()
                raise psycopg.Rollback()
            return written

        written, plans = explained(ledger, mode, finish)
        assert sorted(r["done"] for r in written) == [5] * 400, mode
        assert_linear(plans, live, f"finish, {mode}")
        hand_back(ledger)


def _one_message_runs(ledger: str, users: list[str]) -> list[Finished]:
    """A finished run with one message for each of ``users``, over its one running event."""
    ids = {
        r["user_id"]: r["id"] for r in query(ledger, "SELECT user_id, id FROM events WHERE user_id = ANY(%s)", (users,))
    }
    now = datetime.now(UTC)
    return [
        Finished(
            Claim(
                user,
                HOME,
                1,
                [EventRow(event_id, user, "chat", f"{user}-1", "chat.message", "{}", None, now, 1)],
                0,
                now,
            ),
            datetime(2020, 1, 1, tzinfo=UTC),
            result=RunResult(RunOutcome.MESSAGE, messages=[OutMessage("hi")]),
        )
        for user, event_id in ids.items()
    ]


def test_a_group_finish_reads_its_runs_not_every_running_row(ledger):
    users = seed_pending(ledger, 3000, status="running")
    runs = _one_message_runs(ledger, users[:20])
    # 20 runs finished among 3,000 running users: the plan stays near 20 rows per step.
    assert _explain(ledger, Q.finish_runs, finish_runs_params([run_record(r) for r in runs], "test-worker")) <= 100


def test_rule_2_reads_the_retries_not_the_backlog(ledger):
    seed_pending(ledger, 1000, per_user=5)
    query(ledger, "UPDATE events SET attempts = 3 WHERE user_id = 'u00007'")  # one exhausted user among 5,000 rows
    query(ledger, "ANALYZE events")
    params = {"topics": ["events"], "partitions": [0], "epochs": [1], "max_attempts": 3, "now": None}
    assert _explain(ledger, Q.mark_exhausted_dead, params) <= 50
    dead = claim_dead(ledger)
    assert sorted(r.user_id for r in dead) == ["u00007"] * 5


def claim_dead(ledger: str) -> list[DeadEvent]:
    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await mark_dead(conn, OWNED, 3)

    return asyncio.run(go())


def test_a_pass_in_between_does_not_cancel_a_requested_one(monkeypatch):
    """The claim loop itself (its passes recorded, no ledger) on a clock the test moves: a
    wake-up asked for at +0.3 s still happens when a pass runs in between, and the periodic
    pass comes a scan interval after the last pass, not before."""
    from vigil.settings import load
    from vigil.worker.runner import Runner
    from vigil.worker.settings import WorkerSettings

    monkeypatch.setenv("VIGIL_DATABASE_URL", "postgresql://unused@127.0.0.1/unused")
    settings = load(WorkerSettings, scan_interval_s=1.0)
    clock = ManualClock(1_000.0)
    runner = Runner(settings, agent=None, pool=None, dead_letters=None, clock=clock)
    passes: list[float] = []

    async def record_pass():
        passes.append(round(clock.monotonic() - 1_000.0, 6))

    runner.claimer._claim_pass = record_pass

    async def loop_turn() -> None:
        """Let the loop see the clock: it wakes, passes if one is due, and waits again. Its
        pass awaits nothing (recorded, not run), so a few turns of the event loop do it."""
        runner.wakeups.interrupt()
        for _ in range(20):
            await asyncio.sleep(0)

    async def go():
        loop_task = asyncio.create_task(runner.claimer.claim_loop())
        await loop_turn()  # the first pass, at start
        runner.wake(0.3)  # the window of what was just recorded ends then
        clock.advance(0.1)
        runner.wake()  # a finish frees a slot: a pass now
        await loop_turn()
        clock.advance(0.19)
        await loop_turn()  # not yet
        clock.advance(0.01)
        await loop_turn()  # the requested one, not cancelled by the pass in between
        clock.advance(0.99)
        await loop_turn()  # not yet: the scan is an interval after the last pass
        clock.advance(0.01)
        await loop_turn()
        await runner.drain(0)  # nothing runs: it only stops the loop
        await loop_task

    asyncio.run(go())
    assert passes == [0.0, 0.1, 0.3, 1.3]


def test_a_group_finish_runs_no_trigger_per_message(ledger):
    """The finish statement's whole cost is its plan, which the tests above bound. A trigger
    it fires runs queries of its own, planned from statistics no test here controls: the
    outbox's foreign key to runs (dropped by migration 0022) checked every message with one,
    and on a ledger whose runs table was analyzed small that check scanned every run (a
    group of 170 one-message runs: 12.8 ms on a fresh ledger, 39.5 ms 5,100 runs later)."""
    users = seed_pending(ledger, 20, status="running")
    query(ledger, "ANALYZE runs")  # empty: the statistics a new installation starts with
    query(
        ledger,
        "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome)"
        " SELECT 'old', 'events', 0, 1, 'w', '{}', now(), now(), 'nothing' FROM generate_series(1, 5000)",
    )
    runs = [run_record(r) for r in _one_message_runs(ledger, users)]
    with psycopg.connect(ledger, row_factory=dict_row) as conn:
        explained = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + Q.finish_runs, finish_runs_params(runs, "test-worker")
        ).fetchone()["QUERY PLAN"][0]
        conn.rollback()
    assert _max_rows_per_node(explained["Plan"]) <= 100
    assert explained.get("Triggers", []) == [], explained["Triggers"]


def test_a_pass_starts_at_most_the_claim_pass_max_and_asks_for_the_next_at_once(ledger, monkeypatch):
    """VIGIL_CLAIM_PASS_MAX bounds a pass below the free run slots, and a pass that filled it
    asks for the next one at once (the rest must not wait for a wake-up that may never come);
    the last, short of it, does not."""
    from psycopg_pool import AsyncConnectionPool

    from vigil.ledger.db import connection_kwargs
    from vigil.settings import load
    from vigil.worker.claim_loop import Claimer
    from vigil.worker.settings import WorkerSettings
    from vigil.worker.wakeups import Wakeups

    users = seed_pending(ledger, 7)
    monkeypatch.setenv("VIGIL_DATABASE_URL", ledger)
    settings = load(WorkerSettings, claim_pass_max=3, run_concurrency=10, scan_interval_s=60.0)
    clock = ManualClock(time.time())  # the claim's batch window is judged on it

    class StartedRuns:
        """The claim pass's side of Runs: what it starts, nothing run."""

        needs_context = False

        def __init__(self) -> None:
            self.active = {}

        def start(self, active) -> None:
            self.active[active.claim.user_id] = active

    async def go():
        async with AsyncConnectionPool(ledger, min_size=1, kwargs=connection_kwargs(autocommit=True)) as pool:
            runs = StartedRuns()
            wakeups = Wakeups(clock, settings.scan_interval_s)
            claimer = Claimer(settings, pool, None, runs, wakeups, clock)
            claimer.owned = dict(OWNED)
            passes = []
            for _ in range(3):
                wakeups.begin_pass()
                before = len(runs.active)
                await claimer._claim_pass()
                passes.append((len(runs.active) - before, wakeups.due_in() <= 0))
            return passes, sorted(runs.active)

    passes, started = asyncio.run(go())
    assert passes == [(3, True), (3, True), (1, False)]
    assert started == users


def test_a_claim_range_is_two_round_trips_and_a_failed_one_leaves_nothing_open(ledger):
    """The claim's transaction goes as one pipeline: BEGIN, the settings and the choice in one
    round trip, the write and the COMMIT in the next (a database across a network adds every
    round trip to every pass). One that fails midway is rolled back: its connection goes back
    to the pool idle, and no row stays claimed."""
    from vigil_dev.bench.pgproxy import PgProxy

    users = seed_pending(ledger, 6)

    async def go(dsn: str, timeout_ms: int = 0, proxy: PgProxy | None = None):
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
            if timeout_ms:
                await conn.execute(f"SET lock_timeout = {timeout_ms}")
            before = proxy.round_trips() if proxy else 0
            try:
                return await claim(
                    conn, owned=OWNED, busy=[], max_users=3, batch_max=50, window_s=0.0, max_attempts=3, cursor=""
                ), (proxy.round_trips() - before if proxy else 0)
            finally:
                assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE

    with PgProxy(ledger) as proxy:
        (claims, cursor), round_trips = asyncio.run(go(proxy.dsn, proxy=proxy))
    assert round_trips == 2
    assert sorted(c.user_id for c in claims) == users[0:3] and cursor == users[2]

    # A takeover holds the partition (FOR UPDATE, as take_over does): the claim's FOR SHARE times out.
    with psycopg.connect(ledger, autocommit=False) as holder:
        holder.execute("SELECT 1 FROM partitions WHERE topic = 'events' AND partition = 0 FOR UPDATE")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            asyncio.run(go(ledger, timeout_ms=200))
        holder.rollback()
    assert query(ledger, "SELECT count(*) AS n FROM events WHERE status = 'running'") == [{"n": 3}]
