"""Background tasks on real workers, a real broker and a real ledger (docs/tasks.md).

The echo agent delegates on ``delegate: <instructions>`` and executes a task by answering
``done: <instructions>``; its crash, sleep and fail hooks apply to a task's instructions, so
these tests SIGKILL, freeze and stall a task's holder for real. Each test is named after what
must hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from support import query, scalar, wait_for
from vigil.clock import ManualClock, utc
from worker_support import FAST, chat, metric, produce

# Heartbeats every 0.3 s; a holder silent for 1.5 s is presumed gone.
TASK_FAST = {**FAST, "VIGIL_TASK_HEARTBEAT_S": "0.3", "VIGIL_TASK_STALE_S": "1.5"}


def worker_env(vigil_env, **extra):
    from vigil_dev.devstack import free_port

    return {**vigil_env, **TASK_FAST, "VIGIL_AGENT": "echo", "VIGIL_WORKER_PORT": str(free_port()), **extra}


def start(spawn, env, name):
    return spawn(["worker"], env, name=name).wait_healthy(int(env["VIGIL_WORKER_PORT"]))


def task_row(ledger: str) -> dict:
    rows = query(ledger, "SELECT * FROM tasks")
    assert len(rows) == 1, rows
    return rows[0]


def task_status(ledger: str) -> str | None:
    return scalar(ledger, "SELECT status FROM tasks")


def outbox_bodies(ledger: str, user: str) -> list[str]:
    return [r["body"] for r in query(ledger, "SELECT body FROM outbox WHERE user_id = %s ORDER BY id", (user,))]


def test_background_task_result_wakes_parent_once(stack, topics, ledger, vigil_env, spawn):
    """delegate -> the run's finish queues the task -> a worker executes it -> one result event
    (source task, the task id as its dedup key) -> the parent's next run replies once."""
    start(spawn, worker_env(vigil_env), "w")
    produce(stack.bootstrap, topics.events, [chat("ann", "delegate: count the stars")])
    wait_for(lambda: task_status(ledger) == "succeeded", 30, "the task succeeded")
    wait_for(lambda: len(outbox_bodies(ledger, "ann")) == 2, 30, "two messages: started, then the result")
    started, result = outbox_bodies(ledger, "ann")
    task = task_row(ledger)
    assert started == f"started task {task['id']}"
    assert result == f"task {task['id']} succeeded: done: count the stars"
    assert (task["attempts"], task["lease_epoch"], task["depth"]) == (1, 1, 1)
    assert task["owner_chain"][0] == "ann" and task["reported_at"] is not None
    events = query(ledger, "SELECT source, source_id, kind, status FROM events WHERE source = 'task'")
    assert events == [{"source": "task", "source_id": task["id"], "kind": "task.succeeded", "status": "done"}]
    # The run that delegated is the task's parent; what the task spent is on the parent's row.
    parent = query(ledger, "SELECT * FROM runs WHERE id = %s", (task["run_id"],))[0]
    assert task["parent_run_key"].startswith("ann:")
    spent = (parent["task_turns"], parent["task_input_tokens"], parent["task_output_tokens"])
    assert spent == (1, len("count the stars"), len("count the stars") + 6), spent
    others = scalar(ledger, "SELECT sum(task_input_tokens) FROM runs WHERE id <> %s", (task["run_id"],))
    assert others in (None, 0)  # added once, to its parent only


def test_killed_holder_task_completes_once_on_another_worker(stack, topics, ledger, vigil_env, spawn):
    """SIGKILL of the worker executing a task: after the heartbeat bound another worker takes
    it (attempt 2, lease 2), it completes once, and there is one result event."""
    a = start(spawn, worker_env(vigil_env, VIGIL_ECHO_CRASH_ON="crashme"), "a")
    produce(stack.bootstrap, topics.events, [chat("bob", "delegate: crashme softly")])
    wait_for(lambda: not a.alive(), 30, "the holder died executing the task")
    row = task_row(ledger)
    assert (row["status"], row["attempts"], row["lease_epoch"]) == ("running", 1, 1)
    began = time.monotonic()
    env_b = worker_env(vigil_env, VIGIL_ECHO_CRASH_ON="never-matches")
    start(spawn, env_b, "b")
    # b's own hooks do not crash it: the task's instructions only crash "a".
    wait_for(lambda: task_status(ledger) == "succeeded", 40, "the task completed on the other worker")
    took = time.monotonic() - began
    row = task_row(ledger)
    assert (row["attempts"], row["lease_epoch"]) == (2, 2)
    assert "no heartbeat" in (row["error"] or "") or row["error"] is None
    assert row["result"] == "done: crashme softly"
    wait_for(lambda: len(outbox_bodies(ledger, "bob")) == 2, 40, "the parent told once")
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source = 'task'") == 1
    assert metric(int(env_b["VIGIL_WORKER_PORT"]), "vigil_tasks_reaped_total", 'status="queued"') == 1
    assert took < 30


@pytest.mark.partitions(1)
def test_frozen_holder_late_result_is_refused(stack, topics, ledger, vigil_env, spawn):
    """SIGSTOP the holder past the heartbeat bound: another worker takes the task and
    completes it; SIGCONT: the first holder's late result matches nothing. One outcome stands."""
    env_a = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slowtask:3")
    a = start(spawn, env_a, "a")
    produce(stack.bootstrap, topics.events, [chat("cy", "delegate: slowtask please")])
    wait_for(lambda: task_status(ledger) == "running", 30, "a holds the task")
    a.signal(signal.SIGSTOP)
    try:
        start(spawn, worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="never-matches:0"), "b")
        wait_for(lambda: task_status(ledger) == "succeeded", 40, "b completed the task")
        won = task_row(ledger)
        assert (won["attempts"], won["lease_epoch"]) == (2, 2)
    finally:
        a.signal(signal.SIGCONT)
    port_a = int(env_a["VIGIL_WORKER_PORT"])
    wait_for(
        lambda: (
            sum(
                metric(port_a, name)
                for name in (
                    "vigil_task_leases_lost_total",
                    "vigil_task_late_outcomes_total",
                    "vigil_task_self_fenced_total",
                )
            )
            >= 1
        ),
        30,
        "a's late outcome refused",
    )
    after = task_row(ledger)
    assert (after["status"], after["lease_epoch"], after["finished_at"]) == (
        "succeeded",
        2,
        won["finished_at"],
    )
    assert metric(port_a, "vigil_tasks_total") == 0  # nothing of a's stood
    wait_for(lambda: len(outbox_bodies(ledger, "cy")) == 2, 40, "the parent told once")
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source = 'task'") == 1


def test_cancel_stops_a_running_task_within_a_heartbeat(stack, topics, ledger, vigil_env, spawn):
    """`vigil tasks cancel` on a running task: its worker stops it at its next heartbeat, the
    status is cancelled with the usage spent so far, and the parent is told."""
    env = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="forever:600")
    start(spawn, env, "w")
    produce(stack.bootstrap, topics.events, [chat("dee", "delegate: forever and ever")])
    wait_for(lambda: task_status(ledger) == "running", 30, "the task runs")
    task_id = task_row(ledger)["id"]
    out = _vigil(["tasks", "cancel", task_id, "--actor", "test-operator"], env)
    assert "cancel requested" in out
    wait_for(lambda: task_status(ledger) == "cancelled", 10, "cancelled")
    row = task_row(ledger)
    # From the request's commit to the cancelled outcome's, both on the ledger's clock: a
    # heartbeat (0.3 s) and two commits, with slack for a loaded 2-core machine.
    assert (row["finished_at"] - row["cancel_requested_at"]).total_seconds() < 2.0
    assert row["cancel_requested_by"] == "test-operator"
    assert row["error"] == "cancelled by its owner while it ran"
    assert row["input_tokens"] == len("forever and ever")  # partial usage kept
    wait_for(lambda: len(outbox_bodies(ledger, "dee")) == 2, 30, "the parent told")
    assert outbox_bodies(ledger, "dee")[1] == f"task {task_id} cancelled: cancelled by its owner while it ran"
    audit = query(ledger, "SELECT actor, action FROM audit")
    assert audit == [{"actor": "test-operator", "action": "task.cancel"}]


def test_depth_past_the_bound_is_refused(stack, topics, ledger, vigil_env, spawn):
    """VIGIL_MAX_DELEGATION_DEPTH=0: a run may not delegate; nothing is queued."""
    start(spawn, worker_env(vigil_env, VIGIL_MAX_DELEGATION_DEPTH="0"), "w")
    produce(stack.bootstrap, topics.events, [chat("eve", "delegate: anything")])
    wait_for(lambda: len(outbox_bodies(ledger, "eve")) == 1, 30, "the reply")
    assert outbox_bodies(ledger, "eve") == ["delegation refused: past the delegation depth bound"]
    assert scalar(ledger, "SELECT count(*) FROM tasks") == 0


def _vigil(args: list[str], env: dict[str, str]) -> str:
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "vigil", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- the lifecycle's races, on the ledger alone ---------------------------------------------


async def _tasks_conn(ledger: str) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(ledger, autocommit=True, row_factory=dict_row)


def _new_task(task_id: str, timeout_s: float = 600.0):
    from vigil.ledger.tasks import NewTaskRow

    return NewTaskRow(
        id=task_id,
        user_id="race",
        parent_run_key="race:1:1:1",
        parent_task_id=None,
        session_id=None,
        depth=1,
        owner_chain=["race", "race:1:1:1"],
        instructions="x",
        tools=[],
        token_budget=100,
        max_attempts=2,
        timeout_s=timeout_s,
    )


async def _silence(conn: psycopg.AsyncConnection, task_id: str, seconds: float) -> None:
    """The task's holder silent for ``seconds`` of the ledger's clock, the one that stamps
    heartbeats and judges their age: its last heartbeat moved back by that much."""
    await conn.execute(
        "UPDATE tasks SET heartbeat_at = heartbeat_at - make_interval(secs => %s) WHERE id = %s", (seconds, task_id)
    )


def _seed_task(ledger: str, task_id: str) -> None:
    """One queued task of user ``race``."""
    from vigil.ledger import tasks as ledger_tasks

    async def seed():
        conn = await _tasks_conn(ledger)
        await ledger_tasks.create(conn, _new_task(task_id))
        await conn.close()

    asyncio.run(seed())


def test_timeout_racing_success_leaves_one_terminal_status(ledger):
    """For 40 tasks past their deadline, the holder's success and the reaper's timeout are sent
    at the same moment from two connections: each task ends with exactly one terminal status,
    and exactly one of the two writers is told it won."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    async def go():
        setup, holder, reaper = await _tasks_conn(ledger), await _tasks_conn(ledger), await _tasks_conn(ledger)
        ids = [f"tsk_race_{i}" for i in range(40)]
        for task_id in ids:
            await ledger_tasks.create(setup, _new_task(task_id))
        claimed = await ledger_tasks.claim(setup, "holder-1", 100)
        assert len(claimed) == 40
        wins = []
        for row in claimed:
            # One task at a time past its deadline, so the reaper's statement races this one alone.
            await setup.execute("UPDATE tasks SET deadline = now() - interval '1 second' WHERE id = %s", (row.id,))
            succeeded, reaped = await asyncio.gather(
                ledger_tasks.finish(holder, row.id, row.lease_epoch, ledger_tasks.Outcome(TaskStatus.SUCCEEDED, "ok")),
                ledger_tasks.reap(reaper, 60.0),
            )
            wins.append((succeeded, any(r.id == row.id for r in reaped)))
        final = {r["id"]: r["status"] for r in await (await setup.execute("SELECT id, status FROM tasks")).fetchall()}
        for c in (setup, holder, reaper):
            await c.close()
        return wins, final

    wins, final = asyncio.run(go())
    assert all(a != b for a, b in wins), wins  # exactly one writer won each race
    assert set(final.values()) <= {"succeeded", "timed_out"}
    won_by_holder = sum(a for a, _ in wins)
    assert sum(s == "succeeded" for s in final.values()) == won_by_holder


def test_previous_holder_cannot_heartbeat_or_finish_after_a_reclaim(ledger):
    """A stale holder (reaped, then the task claimed again) is refused by the lease epoch."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    clock = ManualClock(time.time())

    async def go():
        conn = await _tasks_conn(ledger)
        await ledger_tasks.create(conn, _new_task("tsk_old"), now=utc(clock.now()))
        (first,) = await ledger_tasks.claim(conn, "old-holder", 1, now=utc(clock.now()))
        await _silence(conn, "tsk_old", 60.0)  # the holder has been silent for a minute
        reaped = await ledger_tasks.reap(conn, 5.0, now=utc(clock.now()))
        (second,) = await ledger_tasks.claim(conn, "new-holder", 1, now=utc(clock.now()))
        late_beat = await ledger_tasks.heartbeat(conn, "tsk_old", first.lease_epoch)
        late_finish = await ledger_tasks.finish(
            conn, "tsk_old", first.lease_epoch, ledger_tasks.Outcome(TaskStatus.SUCCEEDED, "stale")
        )
        now_beat = await ledger_tasks.heartbeat(conn, "tsk_old", second.lease_epoch)
        final = await ledger_tasks.get(conn, "tsk_old")
        await conn.close()
        return reaped, first, second, late_beat, late_finish, now_beat, final

    reaped, first, second, late_beat, late_finish, now_beat, final = asyncio.run(go())
    assert [r.status for r in reaped] == [TaskStatus.QUEUED]
    assert (first.lease_epoch, second.lease_epoch, second.attempts) == (1, 2, 2)
    assert late_beat is None and late_finish is False
    assert now_beat is False  # alive, no cancel
    assert (final.status, final.lease_holder, final.result) == (TaskStatus.RUNNING, "new-holder", None)


def test_a_task_whose_holders_keep_dying_ends_lost_with_the_reason(ledger):
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    clock = ManualClock(time.time())

    async def go():
        conn = await _tasks_conn(ledger)
        await ledger_tasks.create(conn, _new_task("tsk_doomed"), now=utc(clock.now()))  # max_attempts 2
        statuses = []
        for holder in ("h1", "h2"):
            await ledger_tasks.claim(conn, holder, 1, now=utc(clock.now()))
            await _silence(conn, "tsk_doomed", 60.0)  # its holder silent for a minute
            statuses += [r.status for r in await ledger_tasks.reap(conn, 5.0, now=utc(clock.now()))]
        final = await ledger_tasks.get(conn, "tsk_doomed")
        again = await ledger_tasks.claim(conn, "h3", 1, now=utc(clock.now()))
        await conn.close()
        return statuses, final, again

    statuses, final, again = asyncio.run(go())
    assert statuses == [TaskStatus.QUEUED, TaskStatus.LOST]
    assert final.status == TaskStatus.LOST and final.finished_at is not None
    assert "no heartbeat from h2" in final.error and "attempt 2 of 2" in final.error
    assert again == []  # never silently re-created or re-run


def test_cli_cancel_exit_codes_agree_with_the_api(ledger):
    """`vigil tasks cancel`: a queued task is cancelled (exit 0, as the API's 200); a task
    already terminal is left as it is and exits 4, a conflict (as the API's 409), with or
    without --json; an unknown task exits 1 (the API's 404)."""
    import json

    from click.testing import CliRunner

    from vigil.cli import main

    task_id = "tsk_" + "d" * 20
    _seed_task(ledger, task_id)

    def cancel(*args: str):
        env = {"VIGIL_DATABASE_URL": ledger}
        return CliRunner().invoke(main, ["tasks", "cancel", *args, "--actor", "oncall"], env=env)

    first = cancel(task_id)
    assert first.exit_code == 0 and "cancelled (it had not started)" in first.output, first.output
    again = cancel(task_id)
    assert again.exit_code == 4, (again.exit_code, again.output)
    assert "already cancelled" in again.output
    as_json = cancel(task_id, "--json")
    assert as_json.exit_code == 4, (as_json.exit_code, as_json.output)
    shown = json.loads(as_json.stdout)
    assert (shown["cancel_requested"], shown["status"]) == (False, "cancelled")
    unknown = cancel("tsk_" + "e" * 20)
    assert unknown.exit_code == 1 and "no task" in unknown.output
    assert scalar(ledger, "SELECT count(*) FROM audit WHERE action = 'task.cancel'") == 1


def test_reported_at_is_never_before_finished_at(ledger):
    """The reporter's transaction may begin before a task finishes and still see it finished
    (each statement reads what is committed): its reported_at must not be that transaction's
    start, earlier than the finished_at it reports."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    async def go():
        reporter, holder = await _tasks_conn(ledger), await _tasks_conn(ledger)
        await ledger_tasks.create(holder, _new_task("tsk_reported"))
        (claimed,) = await ledger_tasks.claim(holder, "h1", 1)
        async with reporter.transaction():
            await reporter.execute("SELECT now()")  # the transaction has begun: now() is fixed
            await asyncio.sleep(0.05)
            outcome = ledger_tasks.Outcome(TaskStatus.SUCCEEDED, "ok")
            assert await ledger_tasks.finish(holder, claimed.id, claimed.lease_epoch, outcome)
            rows = await ledger_tasks.unreported(reporter, 10)
            assert [r.id for r in rows] == ["tsk_reported"]
            await ledger_tasks.mark_reported(reporter, [r.id for r in rows])
        final = await ledger_tasks.get(holder, "tsk_reported")
        for conn in (reporter, holder):
            await conn.close()
        return final

    final = asyncio.run(go())
    assert final.reported_at >= final.finished_at, (final.finished_at, final.reported_at)


# -- one clock per row, and the lease on the ledger's clock (issue 53 item 5) ----------------

HOUR = 3600.0
ORDER = ("created_at", "started_at", "heartbeat_at", "progress_at", "finished_at", "reported_at")


def _stamps_in_order(row) -> list[str]:
    """The row's stamps that are out of order (created, started, heartbeat, progress, finished,
    reported; a cancel request before the finish): none, on one clock."""
    stamps = [(name, getattr(row, name)) for name in ORDER if getattr(row, name) is not None]
    wrong = [f"{a}={x} > {b}={y}" for (a, x), (b, y) in zip(stamps, stamps[1:]) if x > y]
    if row.cancel_requested_at is not None and row.finished_at is not None:
        if row.cancel_requested_at > row.finished_at:
            wrong.append(f"cancel_requested_at={row.cancel_requested_at} > finished_at={row.finished_at}")
    return wrong


def test_a_tasks_stamps_are_on_one_clock_and_in_order(ledger):
    """Every way a row is stamped, by holders whose hosts read an hour ahead of the ledger:
    a heartbeat that lands while the finish's transaction is open (the issue's heartbeat_at
    after finished_at), a claim then a finish, a sync child started then ended, a task
    claimed then timed out by the reaper, a queued task cancelled, a running one cancelled
    then finished, each then reported. Each row's stamps are on the ledger's clock and in
    order: created <= started <= heartbeat <= progress <= finished <= reported."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    ahead = ManualClock(time.time() + HOUR)  # the holders' and creators' hosts
    now = lambda: utc(ahead.now())  # noqa: E731
    ok = ledger_tasks.Outcome(TaskStatus.SUCCEEDED, "ok")

    async def go():
        holder, finisher = await _tasks_conn(ledger), await _tasks_conn(ledger)
        for task_id in ("tsk_beat_in_finish", "tsk_claimed", "tsk_timed_out", "tsk_cancel_queued", "tsk_cancel_run"):
            await ledger_tasks.create(holder, _new_task(task_id, timeout_s=3 * HOUR), now=now())
        await ledger_tasks.cancel(holder, task_id="tsk_cancel_queued", actor="owner")
        held = {t.id: t for t in await ledger_tasks.claim(holder, "h1", 10, now=now())}
        # A heartbeat that lands while the finish's transaction is open: it commits first.
        beating = held["tsk_beat_in_finish"]
        async with finisher.transaction():
            await finisher.execute("SELECT now()")  # the transaction has begun: now() is fixed
            await asyncio.sleep(0.05)
            assert await ledger_tasks.heartbeat(holder, beating.id, beating.lease_epoch) is False
            assert await ledger_tasks.finish(finisher, beating.id, beating.lease_epoch, ok)
        claimed = held["tsk_claimed"]
        assert await ledger_tasks.finish(holder, claimed.id, claimed.lease_epoch, ok)
        running = held["tsk_cancel_run"]
        await ledger_tasks.cancel(holder, task_id=running.id, actor="owner")
        assert await ledger_tasks.heartbeat(holder, running.id, running.lease_epoch) is True
        outcome = ledger_tasks.Outcome(TaskStatus.CANCELLED, error="cancelled by its owner while it ran")
        assert await ledger_tasks.finish(holder, running.id, running.lease_epoch, outcome)
        ahead.advance(3 * HOUR)  # past tsk_timed_out's deadline on the clock that set it
        reaped = await ledger_tasks.reap(holder, 60.0, now=now())
        assert ("tsk_timed_out", TaskStatus.TIMED_OUT) in [(r.id, r.status) for r in reaped]
        sync = dataclasses.replace(_new_task("tsk_sync", timeout_s=60), max_attempts=1)
        await ledger_tasks.sync_started(holder, sync, now=now())
        await ledger_tasks.sync_ended(holder, task_id="tsk_sync", outcome=ok)
        async with holder.transaction():
            rows = await ledger_tasks.unreported(holder, 10)
            await ledger_tasks.mark_reported(holder, [r.id for r in rows])
        final = {r.id: r for r in await ledger_tasks.of_user(holder, user_id="race")}
        db_now = (await (await holder.execute("SELECT clock_timestamp() AS t")).fetchone())["t"]
        for conn in (holder, finisher):
            await conn.close()
        return final, db_now

    final, db_now = asyncio.run(go())
    assert len(final) == 6 and all(r.finished_at and r.reported_at for r in final.values()), final
    wrong = {task_id: _stamps_in_order(row) for task_id, row in final.items() if _stamps_in_order(row)}
    assert wrong == {}, wrong
    for row in final.values():  # the hosts' hour ahead entered no stamp: all are the ledger's
        assert all(getattr(row, name) is None or getattr(row, name) <= db_now for name in ORDER), row


@pytest.mark.parametrize(
    ("holder_skew", "reaper_skew"),
    [(-HOUR, 0.0), (HOUR, 0.0), (0.0, HOUR), (0.0, -HOUR)],
    ids=["holder-behind", "holder-ahead", "reaper-ahead", "reaper-behind"],
)
def test_a_lease_is_judged_on_the_ledgers_clock_whatever_the_hosts_read(ledger, holder_skew, reaper_skew):
    """A holder and a reaper whose hosts' clocks disagree by an hour (NTP broken on one): the
    lease is neither stolen early (the holder's heartbeat is fresh: nothing is reaped, whichever
    host is behind) nor kept late (once the ledger has taken no heartbeat for the bound, the
    task is taken back, whichever host is ahead). Its silence is the ledger's time since its
    last heartbeat (moved back, as time passing on the ledger would)."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    holder_clock, reaper_clock = ManualClock(time.time() + holder_skew), ManualClock(time.time() + reaper_skew)
    stale_s = 60.0

    async def go():
        holder, reaper = await _tasks_conn(ledger), await _tasks_conn(ledger)
        # A deadline hours away on either clock: only the lease is judged here.
        await ledger_tasks.create(holder, _new_task("tsk_lease", timeout_s=4 * HOUR), now=utc(holder_clock.now()))
        (held,) = await ledger_tasks.claim(holder, "h1", 1, now=utc(holder_clock.now()))
        # The claim is the holder's first heartbeat (and, the holder dying now, its last).
        fresh = await ledger_tasks.reap(reaper, stale_s, now=utc(reaper_clock.now()))
        await _silence(holder, held.id, stale_s - 1)
        within = await ledger_tasks.reap(reaper, stale_s, now=utc(reaper_clock.now()))
        await _silence(holder, held.id, 2.0)
        past = await ledger_tasks.reap(reaper, stale_s, now=utc(reaper_clock.now()))
        for conn in (holder, reaper):
            await conn.close()
        return fresh, within, past

    fresh, within, past = asyncio.run(go())
    assert (fresh, within) == ([], []), "stolen early"
    assert [(r.id, r.status) for r in past] == [("tsk_lease", TaskStatus.QUEUED)], "kept late"


# -- the HTTP API: the owner chain reads and cancels ----------------------------------------


def test_tasks_api_lists_shows_and_cancels_with_json_errors(stack, topics, ledger):
    """GET the user's tasks and one task; cancel a queued one (200, audited with the token's
    name); a second cancel is a 409; unknown and malformed ids are 404s, never 500s."""
    import httpx

    from ingest_support import create_token, start_ingest
    from vigil.ledger import tasks as ledger_tasks

    async def seed():
        conn = await _tasks_conn(ledger)
        await ledger_tasks.create(conn, _new_task("tsk_" + "a" * 20))
        await conn.close()

    asyncio.run(seed())
    token = create_token(ledger, "owner-app")["token"]
    ingest = start_ingest(stack, ledger, topics)
    try:
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=ingest.url, headers=auth, timeout=10) as http:
            listed = http.get("/v1/users/race/tasks").json()["tasks"]
            assert [t["id"] for t in listed] == ["tsk_" + "a" * 20] and listed[0]["status"] == "queued"
            one = http.get("/v1/tasks/tsk_" + "a" * 20)
            assert one.status_code == 200 and one.json()["owner_chain"] == ["race", "race:1:1:1"]
            cancelled = http.post("/v1/tasks/tsk_" + "a" * 20 + "/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            again = http.post("/v1/tasks/tsk_" + "a" * 20 + "/cancel")
            assert again.status_code == 409 and again.json()["error"] == "conflict"
            for bad in ("/v1/tasks/tsk_" + "b" * 20, "/v1/tasks/nope"):
                answer = http.get(bad)
                assert answer.status_code == 404 and answer.json()["error"] == "not_found", bad
            nul = http.get("/v1/tasks/tsk_%00")  # refused at the edge, before any route (issue 16)
            assert nul.status_code == 400 and "error" in nul.json()
            assert http.get("/v1/users/race/tasks?status=bogus").status_code == 400
            assert httpx.get(ingest.url + "/v1/users/race/tasks").status_code == 401
    finally:
        ingest.stop()
    audit = query(ledger, "SELECT actor, action FROM audit WHERE action = 'task.cancel'")
    assert audit == [{"actor": "owner-app", "action": "task.cancel"}]
    assert scalar(ledger, "SELECT cancel_requested_by FROM tasks") == "owner-app"


def test_a_token_scoped_to_another_user_cannot_list_read_or_cancel_the_task(stack, topics, ledger):
    """The owner chain alone: a token for alice's work gets 403 on race's tasks, and the task is
    untouched; a token without the messages scope gets 403 even for its own user."""
    import httpx

    from ingest_support import cli, start_ingest
    from vigil.ledger import tasks as ledger_tasks

    task_id = "tsk_" + "c" * 20

    async def seed():
        conn = await _tasks_conn(ledger)
        await ledger_tasks.create(conn, _new_task(task_id))
        await conn.close()

    asyncio.run(seed())

    def token(*args: str) -> str:
        import json

        return json.loads(cli(ledger, "tokens", "create", *args, "--json"))["token"]

    alices = token("alice-app", "--scope", "messages", "--users", "alice")
    timers_only = token("race-timers", "--scope", "timers", "--users", "race")
    owner = token("race-app", "--scope", "messages", "--users", "race")
    ingest = start_ingest(stack, ledger, topics)
    try:
        for other in (alices, timers_only):
            with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {other}"}, timeout=10) as http:
                for answer in (
                    http.get("/v1/users/race/tasks"),
                    http.get(f"/v1/tasks/{task_id}"),
                    http.post(f"/v1/tasks/{task_id}/cancel"),
                ):
                    assert answer.status_code == 403 and answer.json()["error"] == "forbidden", answer.text
                    assert "tsk_" not in answer.text  # learns nothing of the task
        assert scalar(ledger, "SELECT status FROM tasks") == "queued"
        assert scalar(ledger, "SELECT cancel_requested_at FROM tasks") is None
        with httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {owner}"}, timeout=10) as http:
            assert http.get(f"/v1/tasks/{task_id}").status_code == 200
            assert http.post(f"/v1/tasks/{task_id}/cancel").status_code == 200
    finally:
        ingest.stop()
    assert scalar(ledger, "SELECT status FROM tasks") == "cancelled"


def test_only_an_owner_in_the_chain_may_read_wait_for_or_cancel_over_http_and_the_cli(stack, topics, ledger):
    """The owner-chain rule on every call, token scope still first: a row of race whose chain
    names neither race nor its creator is refused (403) to race's own token on GET, ?wait and
    DELETE, and `vigil tasks show/cancel` refuse it too; race's own task is read and cancelled
    with DELETE /v1/tasks/{id} (the same answers as POST .../cancel)."""
    import json

    import httpx
    from click.testing import CliRunner

    from ingest_support import cli, start_ingest
    from vigil.cli import main
    from vigil.ledger import tasks as ledger_tasks

    owned, stray = "tsk_" + "0" * 20, "tsk_" + "1" * 20

    async def seed():
        conn = await _tasks_conn(ledger)
        await ledger_tasks.create(conn, _new_task(owned))
        foreign = dataclasses.replace(_new_task(stray), parent_run_key="else:1:1:1", owner_chain=["else", "else:1:1:1"])
        await ledger_tasks.create(conn, foreign)
        await conn.close()

    asyncio.run(seed())
    token = json.loads(cli(ledger, "tokens", "create", "race-app", "--scope", "messages", "--users", "race", "--json"))
    ingest = start_ingest(stack, ledger, topics)
    try:
        with httpx.Client(
            base_url=ingest.url, headers={"Authorization": f"Bearer {token['token']}"}, timeout=10
        ) as http:
            for answer in (
                http.get(f"/v1/tasks/{stray}"),
                http.get(f"/v1/tasks/{stray}?wait=1"),
                http.delete(f"/v1/tasks/{stray}"),
                http.post(f"/v1/tasks/{stray}/cancel"),
            ):
                assert answer.status_code == 403 and answer.json()["error"] == "forbidden", answer.text
                assert "tsk_" not in answer.text
            assert http.get(f"/v1/tasks/{owned}").status_code == 200
            deleted = http.delete(f"/v1/tasks/{owned}")
            assert deleted.status_code == 200 and deleted.json()["status"] == "cancelled", deleted.text
            assert http.delete(f"/v1/tasks/{owned}").status_code == 409
    finally:
        ingest.stop()
    env = {"VIGIL_DATABASE_URL": ledger}
    for args in (["show", stray], ["cancel", stray, "--actor", "oncall"]):
        refused = CliRunner().invoke(main, ["tasks", *args], env=env)
        assert refused.exit_code == 1 and "no owner" in refused.output, (args, refused.output)
    assert scalar(ledger, "SELECT status FROM tasks WHERE id = %s", (stray,)) == "queued"
    assert scalar(ledger, "SELECT cancel_requested_at FROM tasks WHERE id = %s", (stray,)) is None


def test_open_tasks_per_user_are_bounded_atomically_by_the_ledger(ledger):
    """VIGIL_MAX_OPEN_TASKS_PER_USER=1 and two finishes of the same user inserting a task at
    once: the second waits for the first (one lock per user) and, seeing one open task, inserts
    its task already failed with the reason, so its result event tells the agent. Never two open."""
    from vigil.ledger import tasks as ledger_tasks

    async def go():
        first, second, watcher = [await _tasks_conn(ledger) for _ in range(3)]
        async with first.transaction():
            # The first finish has counted and inserted; its transaction stays open (uncommitted,
            # so a count under READ COMMITTED elsewhere does not see its task).
            await ledger_tasks.create(first, dataclasses.replace(_new_task("tsk_first"), max_open=1))
            racing = asyncio.create_task(
                _create_in_transaction(second, dataclasses.replace(_new_task("tsk_second"), max_open=1))
            )
            # Until the second has counted and inserted, or waits for the user's lock.
            waits = "SELECT wait_event FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'"
            pid, deadline = second.info.backend_pid, time.monotonic() + 10
            while not racing.done() and not await (await watcher.execute(waits, (pid,))).fetchall():
                assert time.monotonic() < deadline, "the second finish neither waited nor ended"
                await asyncio.sleep(0.01)
        await racing
        rows = {r.id: r for r in await ledger_tasks.of_user(first, user_id="race")}
        for conn in (first, second, watcher):
            await conn.close()
        return rows

    rows = asyncio.run(go())
    assert rows["tsk_first"].status == "queued"
    assert rows["tsk_second"].status == "failed" and rows["tsk_second"].finished_at is not None
    assert "at most 1 open" in rows["tsk_second"].error


async def _create_in_transaction(conn, task) -> None:
    from vigil.ledger import tasks as ledger_tasks

    async with conn.transaction():
        await ledger_tasks.create(conn, task)


# -- a cancel stands (issue 44 item 3) -------------------------------------------------------


def test_a_cancel_requested_before_the_holder_died_is_never_undone(ledger):
    """Cancel a running task whose holder then dies: the reaper ends it cancelled (usage kept),
    never queued; the claim never takes a task whose cancel was requested; and a holder handing
    a cancelled task back ends it cancelled too."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    async def go():
        conn = await _tasks_conn(ledger)
        for task_id in ("tsk_dead_holder", "tsk_handed_back", "tsk_queued_flag"):
            await ledger_tasks.create(conn, _new_task(task_id))
        claimed = {t.id: t for t in await ledger_tasks.claim(conn, "h1", 3)}
        for task_id in claimed:
            await ledger_tasks.cancel(conn, task_id=task_id, actor="owner")
        await conn.execute("UPDATE tasks SET turns = 2, input_tokens = 70, output_tokens = 9")
        # tsk_dead_holder: its holder is silent past the bound.
        await conn.execute("UPDATE tasks SET heartbeat_at = now() - interval '1 hour' WHERE id = 'tsk_dead_holder'")
        reaped = await ledger_tasks.reap(conn, 5.0)
        # tsk_handed_back: its holder shuts down and hands it back.
        released = await ledger_tasks.release(conn, "tsk_handed_back", claimed["tsk_handed_back"].lease_epoch)
        # tsk_queued_flag: queued with a cancel request (as the old reaper left such tasks).
        await conn.execute("UPDATE tasks SET status = 'queued', lease_holder = NULL WHERE id = 'tsk_queued_flag'")
        again = await ledger_tasks.claim(conn, "h2", 10)
        rows = {t: await ledger_tasks.get(conn, t) for t in claimed}
        await conn.close()
        return reaped, released, again, rows

    reaped, released, again, rows = asyncio.run(go())
    assert [(r.id, r.status) for r in reaped] == [("tsk_dead_holder", TaskStatus.CANCELLED)]
    assert released
    assert again == []
    for task_id in ("tsk_dead_holder", "tsk_handed_back"):
        row = rows[task_id]
        assert row.status == TaskStatus.CANCELLED and row.finished_at is not None, row
        assert (row.turns, row.input_tokens, row.output_tokens) == (2, 70, 9)  # partial usage kept
        assert row.attempts == 1 and row.lease_holder is None
        assert "cancelled by owner" in row.error, row.error


def test_a_cancelled_task_whose_holder_was_killed_is_not_run_again(stack, topics, ledger, vigil_env, spawn):
    """SIGKILL the holder, cancel the task while it still looks running (202), start another
    worker: the task ends cancelled without a second attempt, and the parent is told once."""
    env_a = worker_env(vigil_env, VIGIL_ECHO_CRASH_ON="crashme")
    a = start(spawn, env_a, "a")
    produce(stack.bootstrap, topics.events, [chat("fay", "delegate: crashme then stop")])
    wait_for(lambda: not a.alive(), 30, "the holder died executing the task")
    task_id = task_row(ledger)["id"]
    out = _vigil(["tasks", "cancel", task_id, "--actor", "oncall"], env_a)
    assert "cancel requested" in out
    start(spawn, worker_env(vigil_env), "b")
    wait_for(lambda: task_status(ledger) not in ("running", "queued"), 30, "the task ended")
    row = task_row(ledger)
    assert (row["status"], row["attempts"], row["lease_epoch"]) == ("cancelled", 1, 1), row
    assert row["result"] is None
    wait_for(lambda: len(outbox_bodies(ledger, "fay")) == 2, 30, "the parent told")
    assert outbox_bodies(ledger, "fay")[1].startswith(f"task {task_id} cancelled")
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source = 'task'") == 1


# -- a holder that loses the ledger stops (issue 44 item 4) ----------------------------------


def _ticks(path) -> dict[str, list[float]]:
    """When each holder acted: the echo agent's tick lines, by instance."""
    out: dict[str, list[float]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        who, at = line.split()
        out.setdefault(who, []).append(float(at))
    return out


def test_a_holder_cut_off_from_the_ledger_stops_before_another_may_claim(
    stack, topics, ledger, vigil_env, spawn, tmp_path
):
    """Worker A holds a task through a relay that then stops passing bytes (its connections stay
    open: a paused database, a partition). A stops executing at half of VIGIL_TASK_STALE_S after
    its last heartbeat the ledger took; worker B (direct) takes the task back only after the
    whole bound, so no moment has both acting. The margin is measured and printed."""
    from vigil_dev.bench.pgproxy import PgProxy

    ticks = tmp_path / "ticks"
    stale_s, fence_s = 3.0, 1.5
    slow = {
        "VIGIL_TASK_HEARTBEAT_S": "0.5",
        "VIGIL_TASK_STALE_S": str(stale_s),
        "VIGIL_ECHO_SLEEP_ON": "tick:5",
        "VIGIL_ECHO_TICK_FILE": str(ticks),
    }
    with PgProxy(ledger) as proxy:
        env_a = worker_env(vigil_env, VIGIL_DATABASE_URL=proxy.dsn, VIGIL_INSTANCE_ID="a", **slow)
        start(spawn, env_a, "a")
        produce(stack.bootstrap, topics.events, [chat("gus", "delegate: tick along")])
        wait_for(lambda: "a" in _ticks(ticks), 30, "A executes the task")
        time.sleep(1.0)
        proxy.pause()
        time.sleep(0.6)  # a heartbeat already at the server lands; none after
        last_beat = float(scalar(ledger, "SELECT extract(epoch FROM heartbeat_at) FROM tasks"))
        start(spawn, worker_env(vigil_env, VIGIL_INSTANCE_ID="b", **slow), "b")
        wait_for(lambda: task_status(ledger) == "succeeded", 40, "B completed the task")
        proxy.resume()
    acted = _ticks(ticks)
    a_last, b_first = max(acted["a"]), min(acted["b"])
    stopped_after, margin = a_last - last_beat, last_beat + stale_s - a_last
    print(f"A stopped {stopped_after:.2f} s after its last heartbeat (bound {fence_s} s); margin {margin:.2f} s")
    assert a_last < b_first, (a_last, b_first)
    assert stopped_after < fence_s + 0.5, stopped_after  # the bound, and a tick and a cancel
    assert margin > stale_s - fence_s - 0.5, margin
    port_a = int(env_a["VIGIL_WORKER_PORT"])
    wait_for(lambda: metric(port_a, "vigil_task_self_fenced_total") == 1, 20, "A counted its stop")
    row = task_row(ledger)
    assert (row["attempts"], row["lease_epoch"], row["result"]) == (2, 2, "done: tick along")
    assert metric(port_a, "vigil_tasks_total") == 0  # nothing of A's stood


# -- the paths that were untested (issue 44 item 7) ------------------------------------------


def test_a_task_whose_execution_raises_ends_failed_with_the_error(stack, topics, ledger, vigil_env, spawn):
    start(spawn, worker_env(vigil_env, VIGIL_ECHO_FAIL_ON="failme"), "w")
    produce(stack.bootstrap, topics.events, [chat("hal", "delegate: failme now")])
    wait_for(lambda: task_status(ledger) == "failed", 30, "the task failed")
    row = task_row(ledger)
    assert row["error"] == "RuntimeError: echo agent told to fail on 'failme'", row["error"]
    assert (row["attempts"], row["result"], row["input_tokens"]) == (1, None, len("failme now"))
    wait_for(lambda: len(outbox_bodies(ledger, "hal")) == 2, 30, "the parent told")
    assert outbox_bodies(ledger, "hal")[1] == f"task {row['id']} failed: {row['error']}"


def test_a_running_task_reaching_its_deadline_ends_timed_out(stack, topics, ledger, vigil_env, spawn):
    env = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="forever:600", VIGIL_TASK_TIMEOUT_S="3")
    start(spawn, env, "w")
    produce(stack.bootstrap, topics.events, [chat("ida", "delegate: forever more")])
    wait_for(lambda: task_status(ledger) == "running", 30, "the task runs")
    wait_for(lambda: task_status(ledger) == "timed_out", 15, "the task timed out")
    row = task_row(ledger)
    assert 0 <= (row["finished_at"] - row["deadline"]).total_seconds() < 1.5, (row["finished_at"], row["deadline"])
    assert row["attempts"] == 1 and row["input_tokens"] == len("forever more")
    wait_for(lambda: len(outbox_bodies(ledger, "ida")) == 2, 30, "the parent told")
    assert outbox_bodies(ledger, "ida")[1].startswith(f"task {row['id']} timed_out: ")


def test_sigterm_hands_held_tasks_back_and_another_worker_completes_them(stack, topics, ledger, vigil_env, spawn):
    """SIGTERM of a worker holding a task past its grace: the task goes back to queued with its
    attempt given back, the worker exits 0, and another worker completes it at attempt 1."""
    a = start(spawn, worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slowtask:600", VIGIL_SHUTDOWN_GRACE_S="2"), "a")
    produce(stack.bootstrap, topics.events, [chat("jo", "delegate: slowtask handed back")])
    wait_for(lambda: task_status(ledger) == "running", 30, "a holds the task")
    assert a.stop(timeout=20) == 0
    row = task_row(ledger)
    assert (row["status"], row["attempts"], row["lease_holder"], row["lease_epoch"]) == ("queued", 0, None, 1)
    assert "handed back" in a.log()
    start(spawn, worker_env(vigil_env), "b")
    wait_for(lambda: task_status(ledger) == "succeeded", 30, "b completed it")
    row = task_row(ledger)
    assert (row["attempts"], row["lease_epoch"], row["result"]) == (1, 2, "done: slowtask handed back")


REFUSE_OUTCOMES = """
CREATE FUNCTION refuse_outcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the store refuses outcomes'; END $$;
CREATE TRIGGER refuse_outcome BEFORE UPDATE ON tasks FOR EACH ROW
    WHEN (NEW.status = 'succeeded') EXECUTE FUNCTION refuse_outcome();
"""


def _write_pauses(log: str) -> list[float]:
    import re

    return [float(p) for p in re.findall(r"writing its outcome failed \(attempt \d+\), retrying in ([0-9.]+) s", log)]


def test_a_store_error_on_the_outcome_is_retried_with_backoff(stack, topics, ledger, vigil_env, spawn):
    """The ledger refuses the outcome four times: the holder retries with a growing pause
    (vigil.retry.backoff from 0.2 s), not every second, and the outcome stands once it can."""
    w = start(spawn, worker_env(vigil_env, VIGIL_TASK_HEARTBEAT_S="0.5", VIGIL_TASK_STALE_S="8"), "w")
    with psycopg.connect(ledger, autocommit=True) as conn:
        conn.execute(REFUSE_OUTCOMES)
        produce(stack.bootstrap, topics.events, [chat("kim", "delegate: write me down")])
        # The refusals the assertions read (four writes, three pauses between): counted, not
        # slept for, so a slow machine does not leave the test short of them.
        wait_for(lambda: len(_write_pauses(w.log())) >= 4, 30, "four refused writes")
        conn.execute("DROP TRIGGER refuse_outcome ON tasks")
    wait_for(lambda: task_status(ledger) == "succeeded", 20, "the outcome stood")
    pauses = _write_pauses(w.log())
    assert pauses[0] < 0.5 and len(pauses) >= 4, pauses
    assert pauses[3] > 2 * pauses[0], pauses  # backing off
    assert task_row(ledger)["attempts"] == 1


def test_a_holder_that_cannot_write_its_outcome_gives_up_within_the_stale_bound(
    stack, topics, ledger, vigil_env, spawn
):
    """The ledger refuses every outcome: each holder retries for at most VIGIL_TASK_STALE_S,
    then leaves the task to the reaper; after VIGIL_TASK_MAX_ATTEMPTS holders it is lost."""
    with psycopg.connect(ledger, autocommit=True) as conn:
        conn.execute(REFUSE_OUTCOMES)
    w = start(spawn, worker_env(vigil_env, VIGIL_TASK_MAX_ATTEMPTS="2"), "w")
    produce(stack.bootstrap, topics.events, [chat("lu", "delegate: never written")])
    wait_for(lambda: task_status(ledger) == "lost", 30, "the task lost")
    wait_for(lambda: w.log().count("left to the reaper") == 2, 10, "both holders gave up")
    given_up = w.log().count("writing its outcome failed")
    time.sleep(2.0)
    assert w.log().count("writing its outcome failed") == given_up  # no retry goes on
    assert task_row(ledger)["attempts"] == 2


# -- progress (issue 44 item 5) --------------------------------------------------------------


def test_a_running_task_shows_its_progress_on_its_row_and_in_vigil_tasks_show(stack, topics, ledger, vigil_env, spawn):
    """While a task runs, each heartbeat flushes its progress (turns, tokens, the last tool, the
    child's latest note) to its row; `vigil tasks show` prints it; a task whose holder dies after
    a flush and whose cancel the reaper then ends keeps that usage."""
    env = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="longhaul:600")
    w = start(spawn, env, "w")
    produce(stack.bootstrap, topics.events, [chat("mo", "delegate: longhaul survey")])
    wait_for(lambda: scalar(ledger, "SELECT progress_at FROM tasks") is not None, 30, "progress flushed")
    row = task_row(ledger)
    assert row["status"] == "running"
    assert (row["turns"], row["input_tokens"]) == (1, len("longhaul survey"))
    assert row["note"] == "working on: longhaul survey" and row["last_tool"] == "echo"
    shown = _vigil(["tasks", "show", row["id"]], env)
    assert "progress" in shown and "1 turn" in shown and "last tool echo" in shown, shown
    w.kill()
    _vigil(["tasks", "cancel", row["id"], "--actor", "oncall"], env)
    start(spawn, worker_env(vigil_env), "w2")
    wait_for(lambda: task_status(ledger) == "cancelled", 30, "the reaper ended it cancelled")
    after = task_row(ledger)
    assert (after["turns"], after["input_tokens"]) == (1, len("longhaul survey"))  # partial usage kept


# -- owners who can wait (issue 44 item 6, its long-poll) -------------------------------------


def test_get_task_with_wait_long_polls_until_terminal_or_the_wait(stack, topics, ledger):
    """`GET /v1/tasks/{id}?wait=S` answers as soon as the task is terminal, else after S
    seconds with the task as it is; a wait outside 0..60 is a 400; the owner rule holds."""
    import threading

    import httpx

    from ingest_support import create_token, start_ingest

    task_id = "tsk_" + "f" * 20
    _seed_task(ledger, task_id)
    token = create_token(ledger, "owner-app")["token"]
    ingest = start_ingest(stack, ledger, topics)
    try:
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=ingest.url, headers=auth, timeout=30) as http:
            began = time.monotonic()
            still = http.get(f"/v1/tasks/{task_id}?wait=1")
            assert still.status_code == 200 and still.json()["status"] == "queued"
            assert 0.9 <= time.monotonic() - began < 3.0
            for bad in ("61", "-1", "soon"):
                assert http.get(f"/v1/tasks/{task_id}?wait={bad}").status_code == 400, bad
            timer = threading.Timer(1.0, lambda: http.post(f"/v1/tasks/{task_id}/cancel"))
            began = time.monotonic()
            timer.start()
            done = http.get(f"/v1/tasks/{task_id}?wait=20")
            took = time.monotonic() - began
            timer.join()
            assert done.status_code == 200 and done.json()["status"] == "cancelled", done.text
            assert 0.9 <= took < 3.0, took
    finally:
        ingest.stop()


# -- every child visible (issue 44 item 2) ------------------------------------------------------


def test_a_background_tasks_children_point_at_it_and_vigil_tasks_show_draws_the_tree(
    stack, topics, ledger, vigil_env, spawn
):
    """A run delegates a background task (Claude, against the scripted Messages API); the task's
    child delegates one sync and one background child. Both rows name the task as their parent
    (parent_task_id). The sync row is mode sync, succeeded, with its usage, and no worker ever
    claims it (no lease, one attempt) though the executor ran beside it. The background one is
    queued by the task's success, executed, rolled up to the root run, and reported. `vigil
    tasks show` of the task draws its parent run and both children (--json too)."""
    import json

    from vigil_dev.scripted_server import ScriptedServer
    from worker_support import claude_env

    child = {"system": "sub-agent"}
    delegate = {"type": "tool_use", "name": "delegate"}
    both = [
        {**delegate, "input": {"instructions": "count to three", "mode": "sync"}},
        {**delegate, "input": {"instructions": "tally the stars", "mode": "background", "budget": 2000}},
    ]
    rules = [
        {"when": {**child, "user_text": "^count to three$"}, "reply": [{"type": "text", "text": "1 2 3"}]},
        {"when": {**child, "user_text": "^tally the stars$"}, "reply": [{"type": "text", "text": "12 stars"}]},
        {"when": {**child, "tool_result": "delegate"}, "reply": [{"type": "text", "text": "counted: 1 2 3"}]},
        {"when": {**child, "user_text": "^survey$"}, "reply": both},
        {"when": {"tool_result": "delegate"}, "reply": []},
        {"when": {"user_text": "please delegate"}, "reply": [{**delegate, "input": {"instructions": "survey"}}]},
        {"reply": []},  # the tasks' results, when they wake the session
    ]
    with ScriptedServer({"rules": rules}) as server:
        env = claude_env(worker_env(vigil_env), server.base_url)
        spawn(["worker"], env, name="w").wait_healthy(int(env["VIGIL_WORKER_PORT"]), timeout=90)
        produce(stack.bootstrap, topics.events, [chat("tree", "please delegate")])
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM tasks WHERE finished_at IS NOT NULL") == 3, 60, "3 ended")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE source = 'task'") == 2, 30, "2 reported")
        time.sleep(2 * float(TASK_FAST["VIGIL_TASK_STALE_S"]))  # time for any reaper or claim to touch the sync row
    rows = {r["instructions"]: r for r in query(ledger, "SELECT * FROM tasks")}
    task, sync, grandchild = rows["survey"], rows["count to three"], rows["tally the stars"]
    assert (task["mode"], task["status"], task["result"]) == ("background", "succeeded", "counted: 1 2 3"), task
    assert (sync["mode"], sync["status"], sync["result"], sync["depth"]) == ("sync", "succeeded", "1 2 3", 2), sync
    assert (sync["parent_task_id"], sync["parent_run_key"]) == (task["id"], task["id"])
    assert sync["owner_chain"] == [*task["owner_chain"], task["id"]]
    assert sync["turns"] == 1 and sync["input_tokens"] > 0 and sync["output_tokens"] > 0
    assert (sync["attempts"], sync["lease_holder"], sync["lease_epoch"]) == (1, None, 0)  # never claimed
    assert task["turns"] == 3  # its own two turns and its sync child's
    assert (grandchild["mode"], grandchild["status"], grandchild["result"]) == ("background", "succeeded", "12 stars")
    assert (grandchild["parent_task_id"], grandchild["depth"], grandchild["run_id"]) == (task["id"], 2, task["run_id"])
    assert grandchild["owner_chain"] == [*task["owner_chain"], task["id"]]
    rolled = query(ledger, "SELECT task_turns FROM runs WHERE id = %s", (task["run_id"],))[0]["task_turns"]
    assert rolled == task["turns"] + grandchild["turns"], rolled
    events = query(ledger, "SELECT source_id FROM events WHERE source = 'task'")
    assert sorted(e["source_id"] for e in events) == sorted([task["id"], grandchild["id"]])  # a sync child wakes nobody

    shown = _vigil(["tasks", "show", task["id"]], env)
    assert f"{'parent':20} run {task['parent_run_key']}" in shown, shown
    assert f"{'tree':20} {task['id']} background succeeded 3 turns" in shown, shown
    assert f"├─ {sync['id']} sync succeeded 1 turn" in shown, shown
    assert f"└─ {grandchild['id']} background succeeded 1 turn" in shown, shown
    tree = json.loads(_vigil(["tasks", "show", task["id"], "--json"], env))
    assert tree["id"] == task["id"] and tree["parent"] == {"run_key": task["parent_run_key"]}
    kids = [(k["id"], k["mode"], k["status"], k["turns"], k["children"]) for k in tree["children"]]
    assert kids == [(sync["id"], "sync", "succeeded", 1, []), (grandchild["id"], "background", "succeeded", 1, [])]
    up = json.loads(_vigil(["tasks", "show", sync["id"], "--json"], env))
    assert up["parent"]["id"] == task["id"] and up["parent"]["status"] == "succeeded" and up["children"] == []


def test_the_claim_the_reaper_and_the_open_bound_leave_sync_rows_alone(ledger):
    """A sync child's row, even one left `running` by a run that died, is never claimed, never
    counts against VIGIL_MAX_OPEN_TASKS_PER_USER, and is never reported as an event: past its
    deadline the reaper ends it `lost`, already reported."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.states import TaskStatus

    async def go():
        conn = await _tasks_conn(ledger)
        sync = dataclasses.replace(_new_task("tsk_sync", timeout_s=60), max_attempts=1)
        await ledger_tasks.sync_started(conn, sync)
        orphan = dataclasses.replace(_new_task("tsk_orphan", timeout_s=60), max_attempts=1)
        await ledger_tasks.sync_started(conn, orphan)
        clock = ManualClock(time.time())
        claimed = await ledger_tasks.claim(conn, "w", 10, now=utc(clock.now()))
        opened = await ledger_tasks.open_count(conn, "race")
        await ledger_tasks.create(conn, dataclasses.replace(_new_task("tsk_bg"), max_open=1))
        await ledger_tasks.sync_ended(
            conn, task_id="tsk_sync", outcome=ledger_tasks.Outcome(TaskStatus.SUCCEEDED, "ok", None, 1, 10, 5)
        )
        clock.advance(120)
        reaped = await ledger_tasks.reap(conn, 1.0, now=utc(clock.now()))
        claimed += await ledger_tasks.claim(conn, "w", 10, now=utc(clock.now()))
        async with conn.transaction():
            unreported = await ledger_tasks.unreported(conn, 10)
        await conn.close()
        return claimed, opened, reaped, unreported

    claimed, opened, reaped, unreported = asyncio.run(go())
    assert [t.id for t in claimed] == ["tsk_bg"]  # the background task only
    assert opened == 0
    rows = {r["id"]: r for r in query(ledger, "SELECT * FROM tasks")}
    assert rows["tsk_bg"]["status"] == "running"  # not failed by the bound of 1: sync rows do not count
    assert (rows["tsk_sync"]["status"], rows["tsk_sync"]["turns"]) == ("succeeded", 1)
    assert rows["tsk_orphan"]["status"] == "lost" and "its run ended" in rows["tsk_orphan"]["error"]
    assert ("tsk_orphan", TaskStatus.LOST) in [(r.id, r.status) for r in reaped]
    assert all(r["reported_at"] is not None for r in rows.values() if r["mode"] == "sync")
    assert "tsk_orphan" not in [t.id for t in unreported] and "tsk_sync" not in [t.id for t in unreported]


def test_a_tasks_deadline_is_decided_on_its_holders_clock(ledger):
    """A holder whose clock passes the task's deadline while the execution stalls ends it
    `timed_out` at once, whatever the host's clock reads: the deadline is judged on the clock
    the worker was given (here moved an hour by hand), not on time.monotonic()."""
    from vigil.ledger import tasks as ledger_tasks
    from vigil.ledger.db import async_pool
    from vigil.ledger.states import TaskStatus
    from vigil.settings import load
    from vigil.worker.settings import WorkerSettings
    from vigil.worker.tasks import TaskExecutor

    clock = ManualClock(time.time())

    class Stalls:
        """An agent whose task never ends by itself."""

        async def run_task(self, ctx):
            await asyncio.Event().wait()

    async def go():
        conn = await _tasks_conn(ledger)
        await ledger_tasks.create(conn, _new_task("tsk_late", timeout_s=60), now=utc(clock.now()))
        pool = async_pool(ledger, name="tasks-clock", max_size=4, autocommit=True)
        await pool.open()
        settings = load(
            WorkerSettings,
            database_url=ledger,
            run_journal=False,
            task_concurrency=1,
            task_heartbeat_s=0.2,
            task_stale_s=3600.0,
        )
        executor = TaskExecutor(settings, Stalls(), pool, clock=clock)
        claiming = asyncio.create_task(executor.claim_loop())
        try:
            for _ in range(100):
                if executor.holding:
                    break
                await asyncio.sleep(0.05)
            assert executor.holding, "the task was not claimed"
            clock.advance(HOUR)
            status, waited = None, time.monotonic()
            while time.monotonic() - waited < 10:
                status = (await ledger_tasks.get(conn, "tsk_late")).status
                if status != TaskStatus.RUNNING:
                    break
                await asyncio.sleep(0.1)
            return status, time.monotonic() - waited
        finally:
            executor._stopping = True
            claiming.cancel()
            await executor.stop(0.5)
            await pool.close()
            await conn.close()

    status, took = asyncio.run(go())
    assert status == TaskStatus.TIMED_OUT, status
    assert took < 5, took
