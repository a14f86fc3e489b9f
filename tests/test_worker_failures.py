"""Failure cases with real processes: frozen workers, poison events, random SIGKILLs,
foreign partitioners. Each test is named after what must not happen."""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import pytest

from support import query, scalar, wait_for
from vigil.worker.handover import HANDOVER_LEASE_S
from worker_support import FAST, Supervisor, assert_runs_consistent, chat, metric, produce, statuses, wait_all_done


def worker_env(vigil_env, port=None, **extra):
    from vigil_dev.devstack import free_port

    return {**vigil_env, **FAST, "VIGIL_AGENT": "echo", "VIGIL_WORKER_PORT": str(port or free_port()), **extra}


def start(spawn, env, name):
    return spawn(["worker"], env, name=name).wait_healthy(int(env["VIGIL_WORKER_PORT"]))


@pytest.mark.partitions(1)
def test_stale_epoch_finish_writes_nothing(stack, topics, ledger, vigil_env, spawn):
    """A worker frozen past its session timeout loses the partition; the new owner re-claims and
    finishes; the frozen one, resumed, has its finish refused: one run, one outbox row."""
    env_a = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:3")
    a = start(spawn, env_a, "a")
    produce(stack.bootstrap, topics.events, [chat("erin", "slow reply please")])
    wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status = 'running'") == 1, 20, "A claimed")
    epoch_a = scalar(ledger, "SELECT claim_epoch FROM events")
    a.signal(signal.SIGSTOP)
    env_b = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:0.5")
    start(spawn, env_b, "b")
    wait_for(lambda: scalar(ledger, "SELECT epoch FROM partitions") > epoch_a, 30, "B took over (epoch + 1)")
    wait_all_done(ledger, 1, timeout=30)
    a.signal(signal.SIGCONT)
    port_a = int(env_a["VIGIL_WORKER_PORT"])
    wait_for(lambda: metric(port_a, "vigil_stale_finishes_total") >= 1, 30, "A's stale finish refused and counted")
    runs = query(ledger, "SELECT epoch FROM runs")
    assert len(runs) == 1 and runs[0]["epoch"] > epoch_a
    assert scalar(ledger, "SELECT count(*) FROM outbox") == 1
    assert scalar(ledger, "SELECT attempts FROM events") == 2  # A's claim counted, B's claim counted
    assert_runs_consistent(ledger)


@pytest.mark.partitions(2)
def test_poison_event_dies_after_three_claims_without_muting_others(stack, topics, ledger, vigil_env, spawn):
    """Scenario 4. The other users' runs are slow, so they are in flight each time the poison
    event kills the worker: they lose claims with it, but only the poison event dies (its
    last attempt ran alone); they once died beside it, three crashes and they were dead too."""

    def env():
        return worker_env(vigil_env, VIGIL_ECHO_CRASH_ON="poison", VIGIL_ECHO_SLEEP_ON="slow:1.5")

    supervisor = Supervisor(spawn, env, 1)
    try:
        produce(stack.bootstrap, topics.events, [chat("frank", "poison pill"), chat("frank", "healthy one")])
        produce(stack.bootstrap, topics.events, [chat(f"other{i}", f"slow hi {i}") for i in range(6)])
        try:
            wait_for(lambda: statuses(ledger).get("done", 0) == 7, 150, "all but the poison event done", interval=0.5)
        finally:
            for row in query(ledger, "SELECT user_id, status, attempts, lost_claims, error FROM events ORDER BY id"):
                print("event:", dict(row))
    finally:
        supervisor.stop()
    poison = query(ledger, "SELECT status, attempts, error FROM events WHERE payload LIKE '%%poison%%'")[0]
    assert poison["status"] == "dead" and poison["attempts"] == 3
    assert "dead after 3 attempts" in poison["error"]
    assert statuses(ledger) == {"done": 7, "dead": 1}
    assert supervisor.restarts >= 3
    # The others were lost with the worker at least once (else this test proves nothing).
    assert scalar(ledger, "SELECT max(lost_claims) FROM events WHERE user_id LIKE 'other%%'") >= 1
    assert_runs_consistent(ledger)


@pytest.mark.partitions(1)
def test_a_lone_attempt_waits_for_runs_in_flight_only_so_long(stack, topics, ledger, vigil_env, spawn):
    """A lost event's last attempt runs alone, but a run that takes minutes must not stall
    the worker for minutes: after VIGIL_LONE_DRAIN_S it is cancelled and released (its
    attempt given back), the lone attempt runs, and the released run comes back after."""
    env = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="glacial:45", VIGIL_LONE_DRAIN_S="2")
    worker = start(spawn, env, "w")
    produce(stack.bootstrap, topics.events, [chat("slowpoke", "a glacial request")])
    wait_for(
        lambda: scalar(ledger, "SELECT status FROM events WHERE user_id = 'slowpoke'") == "running",
        20,
        "the slow run started",
    )
    began = time.monotonic()
    # An event lost with a crashed worker before, its last attempt due in 4 s: while the slow
    # run is in flight, however long the worker took to start.
    query(ledger, "INSERT INTO users (user_id, home_topic, home_partition) VALUES ('lone', %s, 0)", (topics.events,))
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, attempts, lost_claims,
                                         next_attempt_at, error)
                     VALUES ('lone', 'chat', 'lost-twice', 'chat.message', '{"text": "again"}', now(), 2, 2,
                             now() + interval '4 seconds', 'claim abandoned: its worker lost partition 0')""",
    )
    wait_for(
        lambda: scalar(ledger, "SELECT status FROM events WHERE user_id = 'lone'") == "done",
        30,
        "the lone attempt done",
        interval=0.2,
    )
    # Due after ~4 s, then at most the 2 s drain: far sooner than the 45 s run would have allowed.
    assert time.monotonic() - began < 20
    port = int(env["VIGIL_WORKER_PORT"])
    assert metric(port, "vigil_lone_runs_total") == 1
    assert metric(port, "vigil_claims_released_total") >= 1
    slow = query(ledger, "SELECT status, attempts FROM events WHERE user_id = 'slowpoke'")[0]
    # Released, attempt given back; claimed again once the lone attempt finished.
    wait_for(
        lambda: scalar(ledger, "SELECT status FROM events WHERE user_id = 'slowpoke'") == "running",
        20,
        "the released run claimed again",
    )
    assert scalar(ledger, "SELECT attempts FROM events WHERE user_id = 'slowpoke'") == 1, slow
    lone = query(ledger, "SELECT attempts, lost_claims FROM events WHERE user_id = 'lone'")[0]
    assert (lone["attempts"], lone["lost_claims"]) == (3, 2)
    assert worker.alive()


@pytest.mark.partitions(1)
def test_a_lone_last_attempt_lost_by_a_live_worker_is_not_its_events_death(stack, topics, ledger, vigil_env, spawn):
    """An event lost with its worker before runs its last attempt alone, and a crash there is
    its death. Here the worker does not crash: frozen past its session timeout (a long GC, a
    stalled host), it loses the partition, B takes over first and hands the claim back as a
    lone attempt's loss. A thawed sees its loss, cancels the run and gives the attempt back
    within the verdict's wait (3 session timeouts): the event runs alone again, on B, and is
    done. (Before: B's next pass made it dead, `dead after 3 attempts`, the chaos run's
    `healthy dead 1`.)"""
    env_a = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:30")
    a = start(spawn, env_a, "a")
    query(ledger, "INSERT INTO users (user_id, home_topic, home_partition) VALUES ('lone', %s, 0)", (topics.events,))
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, attempts, lost_claims, error)
           VALUES ('lone', 'chat', 'lost-once', 'chat.message', '{"text": "a slow one"}', now(), 2, 1,
                   'claim abandoned: its worker lost partition 0')""",
    )
    wait_for(lambda: scalar(ledger, "SELECT status FROM events") == "running", 20, "A claimed the lone attempt")
    assert scalar(ledger, "SELECT attempts FROM events") == 3
    epoch_a = scalar(ledger, "SELECT claim_epoch FROM events")
    a.signal(signal.SIGSTOP)
    env_b = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:0.5")
    b = start(spawn, env_b, "b")
    wait_for(lambda: scalar(ledger, "SELECT epoch FROM partitions") > epoch_a, 30, "B took over (epoch + 1)")
    handed = query(ledger, "SELECT status, attempts, lost_claims, claim_epoch FROM events")[0]
    assert handed == {"status": "pending", "attempts": 3, "lost_claims": 2, "claim_epoch": epoch_a}
    a.signal(signal.SIGCONT)
    port_a = int(env_a["VIGIL_WORKER_PORT"])
    wait_for(lambda: metric(port_a, "vigil_lost_claims_forgiven_total") == 1, 15, "A gave the lone attempt back")
    assert "lost partitions: 1 claim(s) a takeover counted as lost with a crashed worker given back" in a.log()
    wait_for(lambda: scalar(ledger, "SELECT status FROM events") in ("done", "dead"), 30, "the event settled")
    event = query(ledger, "SELECT status, attempts, lost_claims, error FROM events")[0]
    assert (event["status"], event["attempts"], event["lost_claims"]) == ("done", 3, 1), event  # the loss uncounted
    assert metric(int(env_b["VIGIL_WORKER_PORT"]), "vigil_lone_runs_total") == 1
    assert a.alive() and b.alive()
    assert_runs_consistent(ledger)


@pytest.mark.slow
@pytest.mark.partitions(4)
def test_random_sigkills_lose_and_duplicate_nothing(stack, topics, ledger, vigil_env, spawn):
    """2,000 events for 200 users through two workers killed at random moments."""
    rng = random.Random(7)
    supervisor = Supervisor(spawn, lambda: worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="zz:0"), 2)
    users = [f"user{i:03d}" for i in range(200)]
    total = 2000
    kills = 0
    try:
        sent = 0
        deadline = time.monotonic() + 20
        while sent < total:
            batch = [chat(rng.choice(users), f"message {sent + i}") for i in range(min(100, total - sent))]
            produce(stack.bootstrap, topics.events, batch)
            sent += len(batch)
            if rng.random() < 0.35 and time.monotonic() < deadline:
                victim = rng.choice(supervisor.workers)
                if victim.alive():
                    victim.kill()
                    kills += 1
            time.sleep(rng.uniform(0.05, 0.4))
        for _ in range(2):  # and a couple more while the backlog drains
            time.sleep(rng.uniform(0.5, 1.5))
            rng.choice(supervisor.workers).kill()
            kills += 1
        wait_all_done(ledger, total, timeout=180)
    finally:
        supervisor.stop()
    assert kills >= 3
    assert statuses(ledger) == {"done": total}
    assert_runs_consistent(ledger)
    # Per-user order: a user's messages appear in replies in the order they were produced.
    for row in query(
        ledger, "SELECT user_id, string_agg(body, E'\\n' ORDER BY id) AS text FROM outbox GROUP BY user_id"
    ):
        numbers = [int(line.split()[1]) for line in row["text"].splitlines()]
        assert numbers == sorted(numbers), row["user_id"]


@pytest.mark.partitions(4)
def test_foreign_partitioner_never_gives_one_user_two_runs(stack, topics, ledger, vigil_env, spawn):
    """One user's events on two partitions owned by two workers: still one run at a time."""
    env_a = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:0.3", VIGIL_BATCH_WINDOW_MS="0")
    env_b = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:0.3", VIGIL_BATCH_WINDOW_MS="0")
    start(spawn, env_a, "a")
    start(spawn, env_b, "b")
    wait_for(
        lambda: scalar(ledger, "SELECT count(DISTINCT holder) FROM partitions") == 2, 30, "both workers hold partitions"
    )
    holders = query(ledger, "SELECT partition, holder FROM partitions ORDER BY partition")
    first = holders[0]
    other = next(h for h in holders if h["holder"] != first["holder"])
    for i in range(20):
        produce(
            stack.bootstrap,
            topics.events,
            [chat("gina", f"slow {i}")],
            partition=first["partition"] if i % 2 == 0 else other["partition"],
        )
        time.sleep(0.05)
    wait_all_done(ledger, 20, timeout=60)
    # The home partition is where the first *recorded* event came from, whichever consumer won.
    home = scalar(ledger, "SELECT home_partition FROM users WHERE user_id = 'gina'")
    assert home in (first["partition"], other["partition"])
    assert scalar(ledger, "SELECT count(DISTINCT kafka_partition) FROM events") == 2
    runs = query(ledger, "SELECT partition FROM runs WHERE user_id = 'gina'")
    assert {r["partition"] for r in runs} == {home}, "runs claimed outside the home partition"
    assert_runs_consistent(ledger)


@pytest.mark.partitions(2)
def test_a_rebalance_does_not_run_again_what_was_in_flight(stack, topics, ledger, vigil_env, spawn, tmp_path):
    """Worker A holds both partitions, its runs waiting on the model until B has joined, then
    3 s more; B joins and takes one partition. Within VIGIL_REVOKE_GRACE_S (default 10 s) A's
    runs of that partition finish and commit under A's epoch: B has nothing to run again and
    A releases nothing. (Cancelled and released at once, B ran them a second time.)"""
    hold = tmp_path / "release"
    env_a = worker_env(
        vigil_env, VIGIL_ECHO_SLEEP_ON="slow:3", VIGIL_INSTANCE_ID="worker-a", VIGIL_ECHO_HOLD_FILE=str(hold)
    )
    a = start(spawn, env_a, "a")
    produce(stack.bootstrap, topics.events, [chat(f"user-{i}", "slow hello") for i in range(12)])
    wait_for(lambda: statuses(ledger).get("running", 0) == 12, 20, "A running every user")
    start(spawn, worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:3", VIGIL_INSTANCE_ID="worker-b"), "b")
    wait_for(lambda: len(query(ledger, HANDING)) == 1, 60, "A handing a partition over")
    hold.touch()  # the runs go on: they finish within the hand-over's grace
    wait_for(
        lambda: {r["holder"] for r in query(ledger, "SELECT holder FROM partitions")} == {"worker-a", "worker-b"},
        60,
        "B holding a partition",
    )
    wait_all_done(ledger, 12, timeout=30)
    moved = query(
        ledger,
        """SELECT r.user_id, r.worker FROM runs r JOIN partitions p ON (p.topic, p.partition) = (r.topic, r.partition)
           WHERE p.holder = 'worker-b'""",
    )
    assert moved, "no run on the partition that moved"
    assert {r["worker"] for r in moved} == {"worker-a"}
    assert scalar(ledger, "SELECT count(*) FROM runs") == 12
    assert scalar(ledger, "SELECT count(*) FROM outbox") == 12
    port_a = int(env_a["VIGIL_WORKER_PORT"])
    assert metric(port_a, "vigil_claims_released_total") == 0
    # Every one of them was still in flight when its partition was revoked (else the test
    # proves nothing), and finished within the grace.
    assert metric(port_a, "vigil_revoke_runs_finished_total") == len(moved)
    assert metric(port_a, "vigil_worker_revoke_seconds_count") >= 1
    assert a.alive()
    assert_runs_consistent(ledger)


HANDING = "SELECT partition FROM partitions WHERE handover_until IS NOT NULL"


def join_while_running(stack, topics, ledger, spawn, env_a: dict, env_b: dict, hold: Path):
    """Worker A runs 12 users' slow runs; B joins and A hands a partition over: ``(a, moving)``.

    A's runs are held (``VIGIL_ECHO_HOLD_FILE``) until the hand-over has begun, then sleep
    their seconds: in flight during the hand-over however long B took to start."""
    a = start(spawn, {**env_a, "VIGIL_ECHO_HOLD_FILE": str(hold)}, "a")
    produce(stack.bootstrap, topics.events, [chat(f"user-{i}", "slow hello") for i in range(12)])
    wait_for(lambda: statuses(ledger).get("running", 0) == 12, 20, "A running every user")
    start(spawn, env_b, "b")
    wait_for(lambda: len(query(ledger, HANDING)) == 1, 60, "A handing a partition over")
    hold.touch()
    return a, scalar(ledger, HANDING)


@pytest.mark.partitions(2)
def test_a_revoke_does_not_stop_the_worker_recording(stack, topics, ledger, vigil_env, spawn, tmp_path):
    """Worker A's runs last until B has joined, then 5 s; B joins and takes one partition. A
    hands it over (its runs finish there under A's epoch, B's takeover waits for them) and
    goes on recording the partition it kept: new events on it are in the ledger while the moved runs still run.
    (Before hand-overs, A's consumer waited in the revoke for those runs, recording nothing.)"""
    env_a = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:5", VIGIL_INSTANCE_ID="worker-a")
    env_b = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:5", VIGIL_INSTANCE_ID="worker-b")
    a, moving = join_while_running(stack, topics, ledger, spawn, env_a, env_b, tmp_path / "release")
    kept = scalar(ledger, "SELECT partition FROM partitions WHERE partition <> %s", (moving,))
    produce(stack.bootstrap, topics.events, [chat(f"fresh-{i}", "quick hello") for i in range(3)], partition=kept)
    fresh = "SELECT count(*) FROM events WHERE user_id LIKE 'fresh-%%'"
    wait_for(lambda: scalar(ledger, fresh) == 3, 20, "A recording the partition it kept")
    # Recorded while the moved partition's runs were still in flight on A, not after them.
    assert scalar(ledger, "SELECT count(*) FROM events WHERE status = 'running' AND user_id LIKE 'user-%%'") > 0
    assert scalar(ledger, "SELECT holder FROM partitions WHERE partition = %s", (moving,)) == "worker-a"
    wait_all_done(ledger, 15, timeout=40)
    moved = query(ledger, "SELECT worker FROM runs WHERE partition = %s", (moving,))
    assert moved and {r["worker"] for r in moved} == {"worker-a"}
    # B takes over once A has ended the hand-over, just after A's last finish commits.
    holder = "SELECT holder FROM partitions WHERE partition = %s"
    wait_for(lambda: scalar(ledger, holder, (moving,)) == "worker-b", 10, "B taking the partition over")
    assert scalar(ledger, "SELECT count(*) FROM runs") == 15
    port_a, port_b = int(env_a["VIGIL_WORKER_PORT"]), int(env_b["VIGIL_WORKER_PORT"])
    assert metric(port_a, "vigil_claims_released_total") == 0
    assert metric(port_a, "vigil_worker_revoke_seconds_sum") < 2  # the callback, not the runs' grace
    assert metric(port_a, "vigil_worker_handover_seconds_count") >= 1
    assert metric(port_b, "vigil_worker_handover_wait_seconds_sum") > 1  # B waited for A's runs
    assert query(ledger, HANDING) == []
    assert a.alive()
    assert_runs_consistent(ledger)


@pytest.mark.partitions(2)
def test_a_joining_worker_records_the_partition_handed_to_it_while_the_hand_over_lasts(
    stack, topics, ledger, vigil_env, spawn, tmp_path
):
    """A's runs last until B has joined, then 12 s; B joins and is given the partition A
    hands over. B records that partition's new events at once, while A's runs on it still run
    under A's epoch (until c390748 B's consumer waited for the hand-over in its assignment
    callback, recording nothing), and claims them only once its takeover follows the hand-over."""
    env_a = worker_env(
        vigil_env, VIGIL_ECHO_SLEEP_ON="slow:12", VIGIL_INSTANCE_ID="worker-a", VIGIL_REVOKE_GRACE_S="30"
    )
    env_b = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:12", VIGIL_INSTANCE_ID="worker-b")
    a, moving = join_while_running(stack, topics, ledger, spawn, env_a, env_b, tmp_path / "release")
    produce(stack.bootstrap, topics.events, [chat(f"fresh-{i}", "quick hello") for i in range(3)], partition=moving)
    fresh = "SELECT count(*) FROM events WHERE user_id LIKE 'fresh-%%'"
    wait_for(lambda: scalar(ledger, fresh) == 3, 20, "B recording the partition handed to it")
    # Recorded during the hand-over: A still holds the partition, its runs still run.
    assert query(ledger, HANDING) == [{"partition": moving}]
    assert scalar(ledger, "SELECT holder FROM partitions WHERE partition = %s", (moving,)) == "worker-a"
    assert scalar(ledger, "SELECT count(*) FROM events WHERE status = 'running' AND user_id LIKE 'user-%%'") > 0
    assert scalar(ledger, "SELECT count(*) FROM events WHERE status <> 'pending' AND user_id LIKE 'fresh-%%'") == 0
    wait_all_done(ledger, 15, timeout=60)
    assert {r["worker"] for r in query(ledger, "SELECT worker FROM runs WHERE user_id LIKE 'fresh-%%'")} == {"worker-b"}
    took_over = scalar(ledger, "SELECT acquired_at FROM partitions WHERE partition = %s", (moving,))
    assert scalar(ledger, "SELECT max(started_at) FROM runs WHERE worker = 'worker-a'") < took_over
    assert metric(int(env_b["VIGIL_WORKER_PORT"]), "vigil_worker_handover_wait_seconds_sum") > 1
    assert metric(int(env_a["VIGIL_WORKER_PORT"]), "vigil_claims_released_total") == 0
    assert a.alive()
    assert_runs_consistent(ledger)


@pytest.mark.partitions(2)
def test_a_worker_stopped_while_it_waits_for_a_hand_over_never_takes_the_partition(
    stack, topics, ledger, vigil_env, spawn, tmp_path
):
    """B is given the partition A hands over (A's runs held until B has stopped, then 2 s) and
    is stopped (SIGTERM) while its takeover waits. B exits at once, without waiting for A's runs, and never takes
    the partition over; the partition goes back to A, which is still handing it over: A's own
    runs finish under its old epoch, then A takes it over and runs what came meanwhile. Every
    user is served once, never two runs at a time, nothing released."""
    hold = tmp_path / "release"
    env_a = worker_env(
        vigil_env,
        VIGIL_ECHO_SLEEP_ON="slow:2",
        VIGIL_INSTANCE_ID="worker-a",
        VIGIL_REVOKE_GRACE_S="30",
        VIGIL_ECHO_HOLD_FILE=str(hold),
    )
    env_b = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:2", VIGIL_INSTANCE_ID="worker-b")
    a = start(spawn, env_a, "a")
    produce(stack.bootstrap, topics.events, [chat(f"user-{i}", "slow hello") for i in range(12)])
    wait_for(lambda: statuses(ledger).get("running", 0) == 12, 20, "A running every user")
    b = start(spawn, env_b, "b")
    wait_for(lambda: len(query(ledger, HANDING)) == 1, 60, "A handing a partition over")
    moving = scalar(ledger, HANDING)
    port_b = int(env_b["VIGIL_WORKER_PORT"])
    wait_for(lambda: metric(port_b, "vigil_partitions_awaiting_takeover") == 1, 20, "B waiting to take over")
    epoch = scalar(ledger, "SELECT epoch FROM partitions WHERE partition = %s", (moving,))
    asked = time.monotonic()
    assert b.stop(timeout=20) == 0
    stopped_in = time.monotonic() - asked
    assert stopped_in < 8, f"B took {stopped_in:.1f}s to stop: it waited for A's hand-over"
    # Still A's, still being handed over (its runs are held): B never took it.
    assert scalar(ledger, "SELECT holder FROM partitions WHERE partition = %s", (moving,)) == "worker-a"
    assert query(ledger, HANDING) == [{"partition": moving}]
    hold.touch()
    produce(stack.bootstrap, topics.events, [chat(f"fresh-{i}", "quick hello") for i in range(3)], partition=moving)
    wait_all_done(ledger, 15, timeout=60)
    assert {r["worker"] for r in query(ledger, "SELECT worker FROM runs")} == {"worker-a"}
    # A took its partition back with a new epoch once its own hand-over had ended.
    assert scalar(ledger, "SELECT epoch FROM partitions WHERE partition = %s", (moving,)) > epoch
    assert query(ledger, HANDING) == []
    fresh_epochs = query(ledger, "SELECT DISTINCT epoch FROM runs WHERE user_id LIKE 'fresh-%%'")
    assert fresh_epochs == [{"epoch": scalar(ledger, "SELECT epoch FROM partitions WHERE partition = %s", (moving,))}]
    assert scalar(ledger, "SELECT count(*) FROM runs") == 15
    assert metric(int(env_a["VIGIL_WORKER_PORT"]), "vigil_claims_released_total") == 0
    assert "taken over once the previous owner's hand-over ends" in b.log()
    assert a.alive()
    assert_runs_consistent(ledger)


@pytest.mark.partitions(2)
def test_a_worker_killed_mid_hand_over_delays_its_partition_only_to_the_lease(
    stack, topics, ledger, vigil_env, spawn, tmp_path
):
    """A hands a partition over to B (a 30 s grace) and is SIGKILLed before its runs finish:
    nobody renews or clears the hand-over, so B's takeover waits out its deadline, never less
    (A might have been alive and committing), but only the lease (5 s), not the grace; then B
    hands A's claims back and runs them. Every user is served once, never two runs at a time."""
    env_a = worker_env(
        vigil_env, VIGIL_ECHO_SLEEP_ON="slow:60", VIGIL_INSTANCE_ID="worker-a", VIGIL_REVOKE_GRACE_S="30"
    )
    env_b = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:0.2", VIGIL_INSTANCE_ID="worker-b")
    a, moving = join_while_running(stack, topics, ledger, spawn, env_a, env_b, tmp_path / "release")
    deadline = scalar(ledger, "SELECT handover_until FROM partitions WHERE partition = %s", (moving,))
    a.signal(signal.SIGKILL)
    wait_all_done(ledger, 12, timeout=60)
    took_over = scalar(ledger, "SELECT acquired_at FROM partitions WHERE partition = %s", (moving,))
    assert took_over >= deadline, "B took the partition over before A's hand-over could have ended"
    waited = metric(int(env_b["VIGIL_WORKER_PORT"]), "vigil_worker_handover_wait_seconds_sum")
    assert waited < HANDOVER_LEASE_S + 3, f"B's takeover waited {waited:.1f}s: the grace, not the lease"
    assert {r["worker"] for r in query(ledger, "SELECT worker FROM runs")} == {"worker-b"}
    assert scalar(ledger, "SELECT holder FROM partitions WHERE partition = %s", (moving,)) == "worker-b"
    assert scalar(ledger, "SELECT count(*) FROM runs") == 12
    assert query(ledger, "SELECT DISTINCT lost_claims FROM events") == [{"lost_claims": 1}]
    assert_runs_consistent(ledger)


@pytest.mark.slow
@pytest.mark.partitions(4)
def test_a_rolling_deploy_runs_nothing_twice(stack, topics, ledger, vigil_env, spawn):
    """Two workers under a steady load of 1 s runs are replaced one by one, as a rolling
    deploy does: a new worker joins (partitions handed over to it while their runs finish),
    then an old one stops on SIGTERM (its runs drain first). Every event runs exactly once,
    in order, never two runs of a user at a time, and nothing is released or recovered."""
    rng = random.Random(11)
    users = [f"user{i:03d}" for i in range(60)]
    workers: dict[str, tuple] = {}

    def up(name: str) -> None:
        env = worker_env(vigil_env, VIGIL_ECHO_SLEEP_ON="slow:1", VIGIL_INSTANCE_ID=name)
        workers[name] = (start(spawn, env, name), int(env["VIGIL_WORKER_PORT"]))

    def counters(name: str) -> dict[str, float]:
        port = workers[name][1]
        names = ("vigil_claims_released_total", "vigil_claims_recovered_total", "vigil_worker_handover_seconds_count")
        return {n: metric(port, n) for n in names}

    up("old-1")
    up("old-2")
    sent, stop = 0, threading.Event()

    def load() -> None:
        # Steady, not growing: up to one event per user waiting or running, topped up every
        # quarter second. An open-ended rate piles up a backlog as long as the steps take on
        # a loaded machine, and every one of those runs is drained at the end.
        nonlocal sent
        while not stop.is_set():
            if sent - statuses(ledger).get("done", 0) < len(users):
                batch = [chat(rng.choice(users), f"slow {sent + i}") for i in range(20)]
                produce(stack.bootstrap, topics.events, batch)
                sent += 20
            time.sleep(0.25)

    producer = threading.Thread(target=load, daemon=True)
    producer.start()
    seen: dict[str, dict[str, float]] = {}

    def ran_runs(name: str) -> bool:
        return scalar(ledger, "SELECT count(*) FROM runs WHERE worker = %s", (name,)) > 0

    def holds(name: str) -> int:
        return scalar(ledger, "SELECT count(*) FROM partitions WHERE holder = %s", (name,))

    # Each step waits for what it is there for, not for a fixed time: every second of load
    # is more than a second of runs to drain at the end.
    try:
        wait_for(lambda: ran_runs("old-1") and ran_runs("old-2"), 60, "both old workers running the load")
        for old, new in (("old-1", "new-1"), ("old-2", "new-2")):
            up(new)  # joins: the old ones hand partitions over to it
            wait_for(lambda new=new: ran_runs(new), 60, f"{new} running a partition handed over to it")
            seen[old] = counters(old)
            assert workers[old][0].stop(60) == 0, f"{old} did not stop cleanly"
            wait_for(lambda old=old: holds(old) == 0, 60, f"{old}'s partitions taken over")
    finally:
        stop.set()
        producer.join(10)
    wait_all_done(ledger, sent, timeout=120)
    seen.update({name: counters(name) for name in ("new-1", "new-2")})
    assert statuses(ledger) == {"done": sent}
    assert_runs_consistent(ledger)
    assert sum(c["vigil_claims_released_total"] + c["vigil_claims_recovered_total"] for c in seen.values()) == 0, seen
    assert scalar(ledger, "SELECT count(*) FROM events WHERE attempts <> 1 OR lost_claims <> 0") == 0
    assert sum(c["vigil_worker_handover_seconds_count"] for c in seen.values()) >= 1, "no hand-over happened"
    for row in query(
        ledger, "SELECT user_id, string_agg(body, E'\\n' ORDER BY id) AS text FROM outbox GROUP BY user_id"
    ):
        numbers = [int(line.split()[1]) for line in row["text"].splitlines()]
        assert numbers == sorted(numbers), row["user_id"]
