"""A ledger that lost its last commits, and claims no live run holds. Each test is named after
what must not happen.

The ledger may lose commits the worker already acted on: a crash with asynchronous commit,
a failover to an asynchronous replica, a backup restored. These tests make it lose them for
real (an older copy of the database put back; a finish rolled back by hand, as a vanished
commit leaves it) and check that nothing acknowledged is lost and nobody is muted.
"""

from __future__ import annotations

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from support import query, scalar, wait_for
from worker_support import FAST, assert_runs_consistent, chat, metric, produce, statuses, wait_all_done


def worker_env(vigil_env, **extra):
    from vigil_dev.devstack import free_port

    return {**vigil_env, **FAST, "VIGIL_AGENT": "echo", "VIGIL_WORKER_PORT": str(free_port()), **extra}


def start(spawn, env, name):
    return spawn(["worker"], env, name=name).wait_healthy(int(env["VIGIL_WORKER_PORT"]))


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> list[int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        found = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
        return [tp.offset for tp in found]
    finally:
        consumer.close()


def replace_database(stack, name: str, source: str) -> None:
    """``name`` becomes a copy of ``source`` (both without connections)."""
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        stack.create_database(conn, name, source)


@pytest.mark.partitions(2)
def test_a_ledger_restored_from_an_older_copy_loses_no_event(stack, topics, ledger, vigil_env, spawn):
    """The ledger goes back in time past events whose Kafka offsets the group committed: a
    restarted worker reads them again from the ledger's own positions and records every
    event exactly once, and each runs."""
    ledger_name = psycopg.conninfo.conninfo_to_dict(ledger)["dbname"]
    snapshot = f"{ledger_name}_snap"
    env = worker_env(vigil_env)
    users = [f"u{i}" for i in range(6)]

    first = start(spawn, env, "first")
    produce(stack.bootstrap, topics.events, [chat(u, f"early {n}", f"early-{u}-{n}") for u in users for n in range(3)])
    wait_all_done(ledger, 18)
    first.stop()
    # The older copy: what the ledger held after the first 18 events.
    replace_database(stack, snapshot, ledger_name)

    second = start(spawn, env, "second")
    produce(stack.bootstrap, topics.events, [chat(u, f"late {n}", f"late-{u}-{n}") for u in users for n in range(4)])
    wait_all_done(ledger, 42)
    second.stop()
    # The group committed past every event (offsets are stored after the ledger commit):
    # the group's offsets alone would never read the late events again.
    assert sum(committed_offsets(stack.bootstrap, env["VIGIL_WORKER_GROUP"], topics.events, 2)) == 42

    # The ledger loses its last commits: the older copy is put back.
    replace_database(stack, ledger_name, snapshot)
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE "{snapshot}"')
    assert scalar(ledger, "SELECT count(*) FROM events") == 18
    assert scalar(ledger, "SELECT sum(next_offset) FROM consumer_positions") == 18

    start(spawn, env, "third")
    wait_all_done(ledger, 42)
    rows = query(ledger, "SELECT source_id, count(*) AS n FROM events GROUP BY source_id")
    assert len(rows) == 42 and all(r["n"] == 1 for r in rows)
    assert scalar(ledger, "SELECT sum(next_offset) FROM consumer_positions") == 42
    # Every late event ran (again) after the restore, in exactly one run.
    ran = query(ledger, "SELECT unnest(event_ids) AS id, count(*) AS n FROM runs WHERE outcome <> 'failed' GROUP BY 1")
    assert len(ran) == 42 and all(r["n"] == 1 for r in ran)
    assert_runs_consistent(ledger)


@pytest.mark.partitions(1)
def test_a_lost_commit_of_the_last_batch_is_recorded_again(stack, topics, ledger, vigil_env, spawn):
    """The ledger loses the last record transaction while the worker runs on (as a failover to
    an asynchronous replica leaves it): the position row goes back and the rows vanish. A
    restarted worker records them once more, and the duplicates it re-reads are dropped."""
    env = worker_env(vigil_env)
    worker = start(spawn, env, "first")
    produce(stack.bootstrap, topics.events, [chat(f"v{i % 3}", f"hi {i}", f"m-{i}") for i in range(7)])
    wait_all_done(ledger, 7)
    produce(stack.bootstrap, topics.events, [chat(f"v{i % 3}", f"hi {i}", f"m-{i}") for i in range(7, 12)])
    wait_all_done(ledger, 12)
    worker.stop()
    # As a lost commit would: the events from offset 7 on, their runs, and the position.
    query(
        ledger,
        "DELETE FROM outbox WHERE run_id IN (SELECT id FROM runs WHERE event_ids && "
        "(SELECT array_agg(id) FROM events WHERE kafka_offset >= 7))",
    )
    query(ledger, "DELETE FROM runs WHERE event_ids && (SELECT array_agg(id) FROM events WHERE kafka_offset >= 7)")
    # The same transaction wrote their dedup keys (event_keys, since the ledger v2 storage).
    query(
        ledger,
        "DELETE FROM event_keys k USING events e WHERE e.kafka_offset >= 7"
        " AND (k.user_id, k.source, k.source_id) = (e.user_id, e.source, e.source_id)",
    )
    query(ledger, "DELETE FROM events WHERE kafka_offset >= 7")
    query(ledger, "UPDATE consumer_positions SET next_offset = 7")
    assert committed_offsets(stack.bootstrap, env["VIGIL_WORKER_GROUP"], topics.events, 1) == [12]

    port = int(env["VIGIL_WORKER_PORT"])
    start(spawn, env, "second")
    wait_all_done(ledger, 12)
    assert sorted(r["source_id"] for r in query(ledger, "SELECT source_id FROM events")) == sorted(
        f"m-{i}" for i in range(12)
    )
    assert scalar(ledger, "SELECT next_offset FROM consumer_positions") == 12
    wait_for(lambda: metric(port, "vigil_events_recorded_total", 'result="new"') == 5, 10, "5 recorded again")
    assert_runs_consistent(ledger)


@pytest.mark.partitions(1)
def test_a_finish_the_ledger_lost_does_not_mute_its_user(stack, topics, ledger, vigil_env, spawn):
    """A finish commit vanished: the claim is `running` at the worker's current epoch while the
    worker believes the run done. The heal releases it within its period, and the user's
    next events run (rule 4 no longer blocks them)."""
    env = worker_env(vigil_env, VIGIL_HEAL_INTERVAL_S="2")
    port = int(env["VIGIL_WORKER_PORT"])
    start(spawn, env, "worker")
    produce(stack.bootstrap, topics.events, [chat("muted", "first", "first")])
    wait_all_done(ledger, 1)
    # What the vanished commit leaves behind: the claim as it was before the finish, no run
    # row, no message.
    query(ledger, "DELETE FROM outbox")
    query(ledger, "DELETE FROM runs")
    query(
        ledger,
        "UPDATE events SET status = 'running', finished_at = NULL, claim_epoch = (SELECT epoch FROM partitions) "
        "WHERE source_id = 'first'",
    )
    produce(stack.bootstrap, topics.events, [chat("muted", "second", "second")])
    wait_all_done(ledger, 2, timeout=20)
    first = query(ledger, "SELECT lost_claims, error FROM events WHERE source_id = 'first'")[0]
    assert first["lost_claims"] == 1  # released by the heal, then run again (its error cleared by the finish)
    assert metric(port, "vigil_claims_healed_total") == 1
    assert statuses(ledger) == {"done": 2}
    assert_runs_consistent(ledger)


@pytest.mark.partitions(1)
def test_the_heal_never_releases_a_live_run(stack, topics, ledger, vigil_env, spawn):
    """Runs that take longer than many heal periods keep their claims: one run each, no
    claim lost, nothing healed."""
    env = worker_env(vigil_env, VIGIL_HEAL_INTERVAL_S="0.2", VIGIL_ECHO_SLEEP_ON="slow:3")
    port = int(env["VIGIL_WORKER_PORT"])
    start(spawn, env, "worker")
    produce(stack.bootstrap, topics.events, [chat(f"s{i}", f"slow {i}") for i in range(5)])
    wait_all_done(ledger, 5, timeout=40)
    assert metric(port, "vigil_claims_healed_total") == 0
    assert scalar(ledger, "SELECT max(lost_claims) FROM events") == 0
    assert scalar(ledger, "SELECT count(*) FROM runs") == 5


@pytest.mark.partitions(2)
def test_a_killed_workers_users_do_not_wait_more_than_15_s(stack, topics, ledger, vigil_env, spawn):
    """Failover at the default session timeout: SIGKILL the worker that owns a user's home
    partition; the user's next message runs on the other worker within 15 s."""
    import time

    from vigil_dev.devstack import free_port

    def env():
        # The default VIGIL_KAFKA_SESSION_TIMEOUT_MS: this measures the shipped failover time.
        return {**vigil_env, "VIGIL_AGENT": "echo", "VIGIL_WORKER_PORT": str(free_port())}

    a = start(spawn, env(), "a")
    b = start(spawn, env(), "b")
    holders = "SELECT count(DISTINCT holder) FROM partitions"
    wait_for(lambda: scalar(ledger, holders) == 2, 60, "each worker owns a partition", interval=0.5)
    produce(stack.bootstrap, topics.events, [chat(f"f{i}", "hello", f"first-{i}") for i in range(8)])
    wait_all_done(ledger, 8)
    victim_holder = scalar(ledger, "SELECT holder FROM partitions WHERE partition = 0")
    victim = a if victim_holder in a.log() else b
    users = [r["user_id"] for r in query(ledger, "SELECT user_id FROM users WHERE home_partition = 0")]
    assert users, "no user homed on partition 0"
    victim.kill()
    killed = time.monotonic()
    produce(stack.bootstrap, topics.events, [chat(u, "again", f"second-{u}") for u in users])
    wait_all_done(ledger, 8 + len(users), timeout=30)
    failover = time.monotonic() - killed
    print(f"failover: SIGKILL -> the killed worker's users run again in {failover:.1f} s")
    assert failover < 15
