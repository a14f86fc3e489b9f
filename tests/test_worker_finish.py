"""The fenced finish against a real ledger, without processes: group commit and its refusals."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg.rows import dict_row

from support import query
from vigil.agent.base import EventRow, MemoryWrite, NewTask, NewTimer, OutMessage, RunResult, Usage
from vigil.clock import ManualClock, SystemClock, utc
from vigil.ledger.claims import Claim
from vigil.ledger.db import async_pool
from vigil.ledger.partitions import PartitionKey
from vigil.ledger.states import RunOutcome
from vigil.worker import handover
from vigil.worker.claim_loop import Claimer
from vigil.worker.finish import Finished, commit_finished
from vigil.worker.finish_loop import FINISH_GATHER_MAX_S, FINISH_GATHER_MIN_GROUP, Finisher, gather_s
from vigil.worker.runs import Active, Runs
from vigil.worker.wakeups import Wakeups

HOME = PartitionKey("events", 0)


def seed(ledger: str, users: list[str], epoch: int = 1) -> dict[str, int]:
    query(ledger, "INSERT INTO partitions (topic, partition, epoch) VALUES ('events', 0, %s)", (epoch,))
    ids = {}
    for user in users:
        query(ledger, "INSERT INTO users (user_id, home_topic, home_partition) VALUES (%s, 'events', 0)", (user,))
        ids[user] = query(
            ledger,
            """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, status, attempts,
                                   claim_epoch)
               VALUES (%s, 'chat', %s, 'chat.message', '{}', now(), 'running', 1, %s) RETURNING id""",
            (user, f"{user}-1", epoch),
        )[0]["id"]
    return ids


def finished(user: str, event_id: int, result: RunResult, epoch: int = 1) -> Finished:
    row = EventRow(event_id, user, "chat", f"{user}-1", "chat.message", "{}", None, datetime.now(UTC), 1)
    claim = Claim(user, HOME, epoch, [row], 0, datetime.now(UTC))
    return Finished(claim, datetime.now(UTC), result=result)


def commit(ledger: str, runs: list[Finished]):
    async def go():
        async with await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row) as conn:
            return await commit_finished(conn, runs, "test-worker")

    return asyncio.run(go())


def test_group_commit_writes_every_run(ledger):
    ids = seed(ledger, ["u1", "u2", "u3"])
    runs = [finished(u, i, RunResult(RunOutcome.MESSAGE, messages=[OutMessage(f"hi {u}")])) for u, i in ids.items()]
    committed, stale = commit(ledger, runs)
    assert len(committed) == 3 and not stale
    assert query(ledger, "SELECT count(*) AS n FROM events WHERE status = 'done'")[0]["n"] == 3
    assert sorted(r["body"] for r in query(ledger, "SELECT body FROM outbox")) == ["hi u1", "hi u2", "hi u3"]


def test_a_group_commit_links_each_write_to_its_own_run_and_counts_tool_calls(ledger):
    """Two runs in one finish transaction share its now(): the console once matched timers and
    memory files to runs by that instant, and showed each run the other's writes. The run id
    on the rows cannot mix them up."""
    ids = seed(ledger, ["u1", "u2"])
    task = NewTask("tsk_00000000000000000001", "look it up", (), 100, 1, 60.0, 3, "u1:1:1:1", ("u1", "u1:1:1:1"))
    one = RunResult(
        RunOutcome.MESSAGE,
        messages=[OutMessage("hi")],
        timers=[NewTimer("followup-1", datetime.now(UTC) + timedelta(hours=1))],
        memory_writes=[MemoryWrite("/memories/one.md", "1")],
        tasks=[task],
        usage=Usage(turns=4, tool_calls=3),
    )
    two = RunResult(RunOutcome.NOTHING, memory_writes=[MemoryWrite("/memories/two.md", "2")])
    committed, _ = commit(ledger, [finished("u1", ids["u1"], one), finished("u2", ids["u2"], two)])
    assert len(committed) == 2
    runs = {r["user_id"]: r for r in query(ledger, "SELECT id, user_id, tool_calls, finished_at FROM runs")}
    assert runs["u1"]["finished_at"] == runs["u2"]["finished_at"]  # the same instant: time cannot tell them apart
    assert (runs["u1"]["tool_calls"], runs["u2"]["tool_calls"]) == (3, 0)
    assert query(ledger, "SELECT run_id FROM timers") == [{"run_id": runs["u1"]["id"]}]
    assert query(ledger, "SELECT run_id FROM tasks") == [{"run_id": runs["u1"]["id"]}]
    memory = {r["path"]: r["run_id"] for r in query(ledger, "SELECT path, run_id FROM memory")}
    assert memory == {"/memories/one.md": runs["u1"]["id"], "/memories/two.md": runs["u2"]["id"]}


def test_stale_epoch_finish_writes_nothing(ledger):
    ids = seed(ledger, ["u1"], epoch=1)
    query(ledger, "UPDATE partitions SET epoch = 2")  # a takeover happened meanwhile
    committed, stale = commit(
        ledger, [finished("u1", ids["u1"], RunResult(RunOutcome.MESSAGE, messages=[OutMessage("late")]))]
    )
    assert not committed and len(stale) == 1
    assert query(ledger, "SELECT count(*) AS n FROM outbox")[0]["n"] == 0
    assert query(ledger, "SELECT count(*) AS n FROM runs")[0]["n"] == 0
    assert query(ledger, "SELECT status FROM events")[0]["status"] == "running"


def test_a_group_commit_is_three_round_trips_whatever_its_size(ledger):
    """BEGIN with the epochs' lock, finish_runs, then the sessions, the tags and the COMMIT
    together (vigil.ledger.db.pipelined_transaction): three round trips for a group of plain
    runs, as many for 2 runs as for 40 (a statement at a time took five)."""
    from vigil_dev.bench.pgproxy import PgProxy

    ids = seed(ledger, [f"u{n:02d}" for n in range(42)])
    runs = [finished(u, i, RunResult(RunOutcome.MESSAGE, messages=[OutMessage(f"hi {u}")])) for u, i in ids.items()]

    async def go(dsn: str, proxy: PgProxy, groups: list[list[Finished]]) -> list[int]:
        trips = []
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
            for group in groups:
                before = proxy.round_trips()
                committed, stale = await commit_finished(conn, group, "test-worker")
                assert len(committed) == len(group) and not stale
                trips.append(proxy.round_trips() - before)
        return trips

    with PgProxy(ledger) as proxy:
        assert asyncio.run(go(proxy.dsn, proxy, [runs[:2], runs[2:]])) == [3, 3]
    assert query(ledger, "SELECT count(*) AS n FROM outbox")[0]["n"] == 42


def test_a_result_the_ledger_refuses_fails_that_run_only(ledger):
    """A memory write outside /memories violates a CHECK: that run becomes a failed attempt,
    its neighbour in the same group commit still lands, and nothing of the bad run is written."""
    ids = seed(ledger, ["good", "bad"])
    good = finished("good", ids["good"], RunResult(RunOutcome.MESSAGE, messages=[OutMessage("fine")]))
    bad = finished(
        "bad",
        ids["bad"],
        RunResult(
            RunOutcome.MESSAGE, messages=[OutMessage("never sent")], memory_writes=[MemoryWrite("/etc/passwd", "x")]
        ),
    )
    committed, stale = commit(ledger, [good, bad])
    assert len(committed) == 2 and not stale
    rows = {r["user_id"]: r for r in query(ledger, "SELECT user_id, status, error FROM events")}
    assert rows["good"]["status"] == "done"
    assert rows["bad"]["status"] == "pending" and "memory_path_confined" in rows["bad"]["error"]
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox")] == ["fine"]
    assert query(ledger, "SELECT outcome FROM runs WHERE user_id = 'bad'")[0]["outcome"] == "failed"
    assert query(ledger, "SELECT count(*) AS n FROM memory")[0]["n"] == 0


def _nothing(*_args: object) -> None:
    """What the finish loop's callbacks do here: no claim loop to wake or to heal."""


def finish_groups(ledger: str, arrivals: list[list[Finished]], ran_s: float) -> list[int]:
    """Run a real finish loop against the ledger and hand it ``arrivals``, each list of runs
    at once as soon as the loop has taken the list before it off its queue (it is then
    waiting for company, or committing), every run having run ``ran_s`` by the finisher's
    clock, which stands still: what happens is the loop's decision, never the machine's
    speed. Return how many runs each finish transaction committed (rows of one transaction
    share its ``xmin``)."""

    async def go():
        pool = async_pool(ledger, name="finish-test", max_size=2, autocommit=True, check=False)
        await pool.open()
        settings = SimpleNamespace(
            finish_batch_max=200, instance_id="test-worker", run_journal_days=0, run_journal=False, handover="finish"
        )
        clock = ManualClock(datetime.now(UTC).timestamp())
        slots = Runs(settings, None, pool, clock)
        finisher = Finisher(settings, pool, slots, clock, wake=_nothing, on_commit_unknown=_nothing)
        loop = asyncio.create_task(finisher.finish_loop())
        try:
            for runs in arrivals:
                while not finisher.finished.empty():
                    # Ready before a gather's timer of the same loop pass: the arrivals are
                    # queued before a group that waits for company could time out.
                    await asyncio.sleep(0)
                for run in runs:
                    run.started_at = utc(clock.now() - ran_s)
                    slots.active[run.claim.user_id] = Active(run.claim)
                    finisher.put(run)
            while not finisher.idle:
                await asyncio.sleep(0.01)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await pool.close()

    asyncio.run(go())
    groups = query(ledger, "SELECT count(*)::int AS n FROM runs GROUP BY xmin ORDER BY min(id)")
    return [r["n"] for r in groups]


def test_runs_that_waited_on_a_model_for_seconds_finish_together(ledger):
    """A finish transaction costs the worker about a millisecond whatever it holds, and runs
    that wait on a model for seconds finish a few at a time: a small group waits a hundredth
    of its run's time (at most 50 ms) for the runs finishing just after it."""
    ids = seed(ledger, ["u1", "u2", "u3"])
    runs = [finished(u, i, RunResult(RunOutcome.MESSAGE, messages=[OutMessage("hi")])) for u, i in ids.items()]
    assert finish_groups(ledger, [runs[:1], runs[1:]], ran_s=4.0) == [3]  # a model call's worth


def test_quick_runs_finish_without_waiting_for_company(ledger):
    """Runs of a few milliseconds (the echo agent, runs under latency-bound load) never wait:
    each commits alone though the next arrives while it is being committed."""
    ids = seed(ledger, ["u1", "u2", "u3"])
    runs = [finished(u, i, RunResult(RunOutcome.MESSAGE, messages=[OutMessage("hi")])) for u, i in ids.items()]
    assert finish_groups(ledger, [[run] for run in runs], ran_s=0.005) == [1, 1, 1]


def finished_in_revokes() -> float:
    return REGISTRY.get_sample_value("vigil_revoke_runs_finished_total") or 0.0


def revoke_with(
    ledger: str, ids: dict[str, int], model_s: float, grace_s: float, hand_over: bool = False, watch: list | None = None
) -> dict[str, dict]:
    """A real finish loop and claimer on the ledger, holding two runs of the partition: user
    ``returned``'s agent has returned (its finish waits for company, as a model-bound run's
    does), user ``working``'s agent answers after ``model_s``. Revoke the partition with
    ``grace_s``; return each user's event as the ledger has it right after the revoke.
    ``hand_over``: the consumer's revoke (:meth:`Claimer.hand_over`), which returns at once;
    the events are then read when the hand-over has ended (``watch``: gets, every 50 ms until
    then, whether the deadline is still ahead)."""

    async def go():
        pool = async_pool(ledger, name="revoke-test", max_size=2, autocommit=True, check=False)
        await pool.open()
        clock = SystemClock()
        settings = SimpleNamespace(
            finish_batch_max=200, instance_id="test-worker", run_journal_days=0, run_journal=False, handover="finish"
        )
        runs = Runs(settings, None, pool, clock)
        claimer = Claimer(settings, pool, None, runs, Wakeups(clock, 60.0), clock)
        claimer.owned = {HOME: 1}
        finisher = Finisher(settings, pool, runs, clock, wake=claimer.wake, on_commit_unknown=claimer.heal_soon)
        loop = asyncio.create_task(finisher.finish_loop())
        try:
            done = finished("returned", ids["returned"], RunResult(RunOutcome.MESSAGE, messages=[OutMessage("hi")]))
            done.started_at = datetime.now(UTC) - timedelta(seconds=4)  # its group waits 40 ms for company
            returned = Active(done.claim, task=asyncio.create_task(asyncio.sleep(0)))
            await returned.task
            late = finished("working", ids["working"], RunResult(RunOutcome.MESSAGE, messages=[OutMessage("late")]))

            async def agent():  # waiting on its model, then its outcome goes to the finisher
                await asyncio.sleep(model_s)
                finisher.put(late)

            working = Active(late.claim, task=asyncio.create_task(agent()))
            runs.active.update({"returned": returned, "working": working})
            finisher.put(done)
            await asyncio.sleep(0.005)  # the finish loop has taken the run and waits for company
            assert finisher.committing == 1
            if hand_over:
                await claimer.hand_over([HOME], grace_s=grace_s)
                assert not claimer.owned and "working" in runs.active  # returned at once
                until = query(ledger, "SELECT handover_until > now() AS set FROM partitions")
                assert until == [{"set": True}], "no hand-over deadline for the next owner to wait for"
                while watch is not None and claimer.handovers._handovers:
                    watch.append(query(ledger, "SELECT handover_until > now() AS ahead FROM partitions")[0]["ahead"])
                    await asyncio.sleep(0.05)
                await claimer.handovers_done(30.0)
                assert query(ledger, "SELECT handover_until FROM partitions") == [{"handover_until": None}]
            else:
                await claimer.revoke([HOME], grace_s=grace_s)
            right_after = {r["user_id"]: r for r in query(ledger, "SELECT user_id, status, attempts FROM events")}
            assert not runs.active and not claimer.owned
            while not finisher.idle:
                await asyncio.sleep(0.01)
            return right_after
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await pool.close()

    return asyncio.run(go())


@pytest.mark.parametrize("grace_s", [0.0, 0.3], ids=["no-grace", "grace-outlived"])
def test_a_revoke_commits_the_runs_that_have_returned_and_releases_the_others(ledger, grace_s):
    """The run whose agent has returned commits before the revoke is done, so the next owner
    does not run it again; the run still waiting on its model when the grace ends is
    cancelled and its claim handed back, its attempt not counted. (Released instead, the
    returned run's finish was refused as stale 40 ms later and its event ran twice.)"""
    ids = seed(ledger, ["returned", "working"])
    query(ledger, "UPDATE events SET attempts = 1")
    before = finished_in_revokes()
    events = revoke_with(ledger, ids, model_s=60.0, grace_s=grace_s)
    assert finished_in_revokes() == before + 1
    assert events["returned"]["status"] == "done"
    assert events["working"]["status"] == "pending" and events["working"]["attempts"] == 0
    assert [r["user_id"] for r in query(ledger, "SELECT user_id FROM runs")] == ["returned"]
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox")] == ["hi"]


def test_a_revoke_lets_runs_finish_within_its_grace(ledger):
    """VIGIL_REVOKE_GRACE_S: the run whose model answers 0.3 s into the revoke finishes and
    commits under our epoch; nothing is handed back to run again."""
    ids = seed(ledger, ["returned", "working"])
    query(ledger, "UPDATE events SET attempts = 1")
    before = finished_in_revokes()
    events = revoke_with(ledger, ids, model_s=0.3, grace_s=10.0)
    assert finished_in_revokes() == before + 2
    assert events["returned"]["status"] == "done" and events["working"]["status"] == "done"
    assert sorted(r["body"] for r in query(ledger, "SELECT body FROM outbox")) == ["hi", "late"]
    assert query(ledger, "SELECT count(*) AS n FROM runs")[0]["n"] == 2


def test_a_hand_over_returns_at_once_and_lets_runs_finish_behind_it(ledger):
    """The consumer's revoke (rule 4): it returns while the run still waits on its model (the
    consumer goes on recording), leaving a deadline the next takeover waits for; the run
    commits 0.3 s later under our epoch, and the deadline is cleared."""
    ids = seed(ledger, ["returned", "working"])
    query(ledger, "UPDATE events SET attempts = 1")
    before = finished_in_revokes()
    events = revoke_with(ledger, ids, model_s=0.3, grace_s=10.0, hand_over=True)
    assert finished_in_revokes() == before + 2
    assert events["returned"]["status"] == "done" and events["working"]["status"] == "done"
    assert sorted(r["body"] for r in query(ledger, "SELECT body FROM outbox")) == ["hi", "late"]


def test_a_hand_over_renews_its_lease_while_its_runs_last(ledger, monkeypatch):
    """The deadline is a lease (renewed while the runs last), so a revoking worker that dies
    holds the next owner back by a lease, not by the grace; a live one never lets it lapse."""
    # The product's proportions (a lease five renewals long), a fifth of its lengths: a lease
    # of 0.3 s renewed every 0.1 s lapsed in a clean-clone run whose load stalled the loop
    # for more than the 0.2 s between them.
    monkeypatch.setattr(handover, "HANDOVER_LEASE_S", 1.0)
    monkeypatch.setattr(handover, "HANDOVER_RENEW_S", 0.2)
    ids = seed(ledger, ["returned", "working"])
    query(ledger, "UPDATE events SET attempts = 1")
    watch: list[bool] = []
    events = revoke_with(ledger, ids, model_s=2.5, grace_s=10.0, hand_over=True, watch=watch)
    assert events["working"]["status"] == "done"
    assert len(watch) >= 15 and all(watch), watch  # 2.5 s of runs, two and a half leases: never lapsed


def test_a_hand_over_releases_what_outlives_its_grace(ledger):
    """Past the grace the hand-over cancels and releases as a revoke does (attempt given back)."""
    ids = seed(ledger, ["returned", "working"])
    query(ledger, "UPDATE events SET attempts = 1")
    events = revoke_with(ledger, ids, model_s=60.0, grace_s=0.3, hand_over=True)
    assert events["returned"]["status"] == "done"
    assert events["working"]["status"] == "pending" and events["working"]["attempts"] == 0


def test_a_finish_frees_only_its_own_runs_slot(ledger):
    """The partition went and came back while a run's finish was in flight, and the user's
    new run holds the slot: the old finish must not free it (the claim pass would then start
    a second run for the user beside the first)."""
    ids = seed(ledger, ["u1"])
    old = finished("u1", ids["u1"], RunResult(RunOutcome.NOTHING))
    runs = Runs(SimpleNamespace(), None, None, SystemClock())
    new = Active(finished("u1", ids["u1"], RunResult(RunOutcome.NOTHING)).claim)
    runs.active["u1"] = new
    runs.forget(old.claim)
    assert runs.active["u1"] is new
    runs.forget(new.claim)
    assert not runs.active


def test_how_long_a_group_waits_for_company():
    assert gather_s(1, 2.0) == 0.02  # a hundredth of the run
    assert gather_s(1, 30.0) == FINISH_GATHER_MAX_S  # capped
    assert gather_s(1, 0.05) == 0.0  # quick runs never wait
    assert gather_s(FINISH_GATHER_MIN_GROUP, 30.0) == 0.0  # a big enough group commits at once


def test_cancelled_runs_are_released_together_each_under_its_own_epoch(ledger):
    """A revoke or shutdown cancelling many runs hands their claims back in one statement per
    partition and epoch (one transaction per run took 6 s for 1,124 runs): every event of a
    partition still at the runs' epoch goes back to pending, its attempt given back; those of
    a partition that moved on in the meantime stay with its new owner."""
    query(ledger, "INSERT INTO partitions (topic, partition, epoch) VALUES ('events', 0, 1), ('events', 1, 2)")
    claims = []
    for i in range(40):
        user, home = f"u{i}", PartitionKey("events", i % 2)
        query(
            ledger, "INSERT INTO users (user_id, home_topic, home_partition) VALUES (%s, 'events', %s)", (user, i % 2)
        )
        ids = [
            query(
                ledger,
                """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, status, attempts,
                                       claim_epoch)
                   VALUES (%s, 'chat', %s, 'chat.message', '{}', now(), 'running', 1, 1) RETURNING id""",
                (user, f"{user}-{n}"),
            )[0]["id"]
            for n in range(2)
        ]
        rows = [
            EventRow(e, user, "chat", f"{user}-{n}", "chat.message", "{}", None, datetime.now(UTC), 1)
            for n, e in enumerate(ids)
        ]
        claims.append(Claim(user, home, 1, rows, 0, datetime.now(UTC)))  # partition 1 moved on to epoch 2

    async def go():
        pool = async_pool(ledger, name="release-test", max_size=2, autocommit=True, check=False)
        await pool.open()
        try:
            runs = Runs(SimpleNamespace(), None, pool, SystemClock())
            victims = []
            for claim in claims:
                victims.append(Active(claim, task=asyncio.create_task(asyncio.sleep(60))))
                runs.active[claim.user_id] = victims[-1]
            await runs.cancel(victims)
            assert not runs.active and all(a.task.cancelled() for a in victims)
        finally:
            await pool.close()

    asyncio.run(go())
    by_partition = {
        (r["home_partition"], r["status"], r["attempts"]): r["n"]
        for r in query(
            ledger,
            """SELECT u.home_partition, e.status, e.attempts, count(*)::int AS n
               FROM events e JOIN users u USING (user_id) GROUP BY 1, 2, 3""",
        )
    }
    assert by_partition == {(0, "pending", 0): 40, (1, "running", 1): 40}


def test_a_release_that_meets_a_finish_moving_one_of_its_rows_still_releases_the_rest(ledger):
    """A run that returned just as it was cancelled is still committed by the finisher: its
    rows move to the finished part while the release of the group waits on one of them, and
    PostgreSQL refuses the release ("tuple ... already moved to another partition"). Run
    again, it releases the rest; failed for good, every claim of the group would wait for the
    next owner's takeover and count as lost."""
    ids = seed(ledger, ["finishing", "cancelled"])
    claims = {user: finished(user, event_id, RunResult(RunOutcome.NOTHING)).claim for user, event_id in ids.items()}

    async def go():
        pool = async_pool(ledger, name="release-race-test", max_size=2, autocommit=True, check=False)
        await pool.open()
        finish = await psycopg.AsyncConnection.connect(ledger)  # a finish, holding the row until it commits
        try:
            await finish.execute(
                "UPDATE events SET status = 'done', finished_at = now() WHERE id = %s", (ids["finishing"],)
            )
            runs = Runs(SimpleNamespace(), None, pool, SystemClock())
            victims = [Active(claim, task=asyncio.create_task(asyncio.sleep(60))) for claim in claims.values()]
            releasing = asyncio.create_task(runs.cancel(victims))
            await asyncio.sleep(0.3)  # the release waits on the finishing row
            assert not releasing.done()
            await finish.commit()
            await releasing
        finally:
            await finish.close()
            await pool.close()

    before = REGISTRY.get_sample_value("vigil_claims_released_total") or 0.0
    asyncio.run(go())
    status = {
        r["user_id"]: (r["status"], r["attempts"])
        for r in query(ledger, "SELECT user_id, status, attempts FROM events")
    }
    assert status == {"finishing": ("done", 1), "cancelled": ("pending", 0)}
    assert REGISTRY.get_sample_value("vigil_claims_released_total") == before + 1


def test_a_revoke_hurries_only_its_own_partitions_finish_groups():
    """While a revoke waits for a partition's runs, a finish group holding one of them commits
    without waiting for company; groups of the other partitions go on gathering (until session
    26 every group of the worker stopped gathering for the whole hand-over)."""
    other = PartitionKey("events", 1)
    runs = Runs(SimpleNamespace(), None, None, SystemClock())
    victim = Active(finished("u1", 1, RunResult(RunOutcome.NOTHING)).claim)
    runs.active["u1"] = victim
    mine = finished("u1", 1, RunResult(RunOutcome.NOTHING))
    theirs = finished("u2", 2, RunResult(RunOutcome.NOTHING))
    theirs.claim = Claim("u2", other, 1, theirs.claim.events, 0, datetime.now(UTC))

    async def go():
        assert not runs.urgent([mine]) and not runs.urgent([theirs])
        waiting = asyncio.create_task(runs.wait_gone([victim], 5.0))
        await asyncio.sleep(0.02)
        assert runs.hurry.is_set()  # wakes a group already waiting: it may hold a returned run
        assert runs.urgent([mine]) and runs.urgent([theirs, mine])
        assert not runs.urgent([theirs])
        runs.forget(victim.claim)
        assert await waiting == []
        assert not runs.urgent([mine])

    asyncio.run(go())
