"""The worker on two ledger shards (issue 41, item 2 for the worker): each user's events,
runs, outbox and each partition's position and epoch on the shard of the user's home
partition, never on the other; an event read on another shard's partition produced again to
its user's home partition; a worker killed mid-run taken over on both shards.

Two shards are two databases of the session's PostgreSQL server (tests/test_shards.py's
fixtures); the worker is a real process on the session's Kafka.
"""

from __future__ import annotations

import pytest

from support import query, scalar, wait_for
from test_operator_failures import vigil
from test_shard_loops import bring_back, take_away
from test_shards import databases, shard_env  # noqa: F401 (the fixture)
from test_worker_failures import start, worker_env
from vigil.ledger.shardmap import ShardMap
from vigil.partitioner import home_partition
from vigil.worker.shards import ShardNotOpen, Shards
from worker_support import assert_runs_consistent, chat, metric, produce, statuses

PARTITIONS = 4  # the topics fixture's default; the catalog's map puts 0, 2 on shard 0 and 1, 3 on shard 1


def users_on(shard: int, n: int) -> list[str]:
    """``n`` user ids whose home partition is on ``shard`` (the rule: partition % 2)."""
    found = [f"user-{i}" for i in range(200) if home_partition(f"user-{i}", PARTITIONS) % 2 == shard]
    return found[:n]


@pytest.fixture
def two_shards(databases, vigil_env):  # noqa: F811 (the fixture imported above)
    """(catalog, other, the worker's env): two migrated shards, the catalog's map seeded."""
    catalog, other = databases(migrated=True), databases(migrated=True)
    env = {**vigil_env, **shard_env(catalog, other, partitions=PARTITIONS)}
    migrated = vigil("migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    return catalog, other, env


def test_one_shard_routes_everything_to_the_catalog_without_the_map():
    catalog = object()
    shards = Shards(catalog)  # type: ignore[arg-type]
    assert shards.single and shards.count == 1 and shards.routes.loaded  # one shard: no map to read
    assert shards.split([3, 1, 2], int) == {0: [3, 1, 2]}
    assert shards.pool_of(7) is catalog and shards.pool_of_user("anyone") is catalog
    assert shards.elsewhere("anyone", 3, partitions=PARTITIONS) is None


def test_two_shards_route_by_the_catalogs_rows_then_the_rule():
    shards = Shards(object(), ShardMap(("postgresql://a/v", "postgresql://b/v"), {2: 1}), partitions=PARTITIONS)  # type: ignore[arg-type]
    assert shards.split([0, 1, 2, 3], int) == {0: [0], 1: [1, 2, 3]}
    user = users_on(1, 1)[0]  # home partition 1 or 3: shard 1
    assert shards.elsewhere(user, 0, partitions=PARTITIONS) == home_partition(user, PARTITIONS)
    assert shards.elsewhere(user, 2, partitions=PARTITIONS) is None  # partition 2 moved to shard 1
    with pytest.raises(ShardNotOpen):
        shards.pool_of(1)


def done(dsn: str) -> int:
    return statuses(dsn).get("done", 0)


def users_of(dsn: str, table: str) -> set[str]:
    return {r["user_id"] for r in query(dsn, f"SELECT DISTINCT user_id FROM {table}")}


def partitions_of(dsn: str, table: str) -> set[int]:
    return {r["partition"] for r in query(dsn, f"SELECT DISTINCT partition FROM {table}")}


def test_each_users_events_runs_and_positions_are_on_their_home_shard_only(stack, topics, two_shards, spawn):
    catalog, other, env = two_shards
    zero, one = users_on(0, 3), users_on(1, 3)
    worker_env_ = worker_env(env)
    worker = start(spawn, worker_env_, "worker")
    produce(stack.bootstrap, topics.events, [chat(u, f"hello {u}") for u in zero + one])
    wait_for(lambda: (done(catalog), done(other)) == (3, 3), 60, "every event done on its shard")
    for dsn, mine in ((catalog, zero), (other, one)):
        for table in ("events", "runs", "outbox", "users"):
            assert users_of(dsn, table) == set(mine), (table, dsn)
        assert partitions_of(dsn, "consumer_positions") <= ({0, 2} if dsn == catalog else {1, 3})
        assert partitions_of(dsn, "partitions") == ({0, 2} if dsn == catalog else {1, 3})
        assert_runs_consistent(dsn)
    # Both shards' partitions were recorded from (positions on each shard, for its partitions only).
    assert partitions_of(catalog, "consumer_positions") and partitions_of(other, "consumer_positions")
    port = int(worker_env_["VIGIL_WORKER_PORT"])
    assert metric(port, "vigil_worker_shard_partitions", 'shard="0"') == 2
    assert metric(port, "vigil_worker_shard_partitions", 'shard="1"') == 2
    assert metric(port, "vigil_events_rerouted_total") == 0
    assert worker.alive()


def test_an_event_on_another_shards_partition_is_recorded_once_on_its_users_home_shard(
    stack, topics, two_shards, spawn
):
    """A producer with another partitioner puts a shard-1 user's event on partition 0 (shard
    0), twice: the worker produces it again to the user's home partition, where it is
    recorded once and run; shard 0 records none of it, and its position moves past both."""
    catalog, other, env = two_shards
    user = users_on(1, 1)[0]
    home = home_partition(user, PARTITIONS)
    worker_env_ = worker_env(env)
    start(spawn, worker_env_, "worker")
    event = chat(user, "lost on the wrong shard", source_id="foreign-1")
    produce(stack.bootstrap, topics.events, [event, event], partition=0)
    wait_for(lambda: done(other) == 1, 60, "the event done on its home shard")
    assert query(other, "SELECT source_id, kafka_partition FROM events") == [
        {"source_id": "foreign-1", "kafka_partition": home}
    ]
    assert scalar(other, "SELECT count(*) FROM runs") == 1
    assert scalar(catalog, "SELECT count(*) FROM events") == 0
    assert scalar(catalog, "SELECT count(*) FROM users") == 0
    wait_for(
        lambda: scalar(catalog, "SELECT next_offset FROM consumer_positions WHERE partition = 0") == 2,
        10,
        "shard 0's position past both copies",
    )
    port = int(worker_env_["VIGIL_WORKER_PORT"])
    assert metric(port, "vigil_events_rerouted_total") == 2
    assert metric(port, "vigil_events_recorded_total", 'result="duplicate"') == 1


def test_a_worker_killed_mid_run_on_two_shards_loses_and_repeats_nothing(stack, topics, two_shards, spawn):
    """Worker A runs users of both shards (slow runs) and is SIGKILLed; B takes every
    partition over on its shard, hands the lost claims back and runs them: every event done
    once, on its home shard."""
    catalog, other, env = two_shards
    zero, one = users_on(0, 4), users_on(1, 4)
    a = start(spawn, worker_env(env, VIGIL_ECHO_SLEEP_ON="slow:3", VIGIL_INSTANCE_ID="worker-a"), "a")
    produce(stack.bootstrap, topics.events, [chat(u, "slow hello") for u in zero + one])
    wait_for(
        lambda: statuses(catalog).get("running", 0) >= 1 and statuses(other).get("running", 0) >= 1,
        30,
        "A running users of both shards",
    )
    a.kill()
    start(spawn, worker_env(env, VIGIL_ECHO_SLEEP_ON="slow:0.2", VIGIL_INSTANCE_ID="worker-b"), "b")
    wait_for(lambda: (done(catalog), done(other)) == (4, 4), 90, "every event done after the takeover")
    for dsn, mine in ((catalog, zero), (other, one)):
        assert users_of(dsn, "events") == set(mine)
        assert scalar(dsn, "SELECT count(*) FROM outbox") == 4
        assert {r["holder"] for r in query(dsn, "SELECT holder FROM partitions")} == {"worker-b"}
        assert_runs_consistent(dsn)


def test_a_shard_that_does_not_answer_stops_only_its_own_users(stack, topics, two_shards, spawn):
    """Shard 1's database refuses connections: shard 0's users go on being recorded, run and
    finished; shard 1's partitions pause (vigil_worker_shard_up 0) and, once it answers again,
    are read again from the ledger's position: every event once, none lost."""
    catalog, other, env = two_shards
    zero, one = users_on(0, 3), users_on(1, 3)
    worker_env_ = worker_env(env)
    worker = start(spawn, worker_env_, "worker")
    port = int(worker_env_["VIGIL_WORKER_PORT"])
    produce(stack.bootstrap, topics.events, [chat(u, f"first {u}") for u in zero + one])
    wait_for(lambda: (done(catalog), done(other)) == (3, 3), 60, "the first round done on both shards")
    take_away(stack, other)
    try:
        produce(stack.bootstrap, topics.events, [chat(u, f"second {u}") for u in one + zero])
        wait_for(lambda: done(catalog) == 6, 30, "shard 0's users served while shard 1 does not answer")
        wait_for(lambda: metric(port, "vigil_worker_shard_up", 'shard="1"') == 0, 10, "shard 1 reported down")
        produce(stack.bootstrap, topics.events, [chat(u, f"third {u}") for u in zero])
        wait_for(lambda: done(catalog) == 9, 30, "and again, still without shard 1")
    finally:
        bring_back(stack, other)
    wait_for(lambda: done(other) == 6, 60, "shard 1's users served once it answers")
    wait_for(lambda: metric(port, "vigil_worker_shard_up", 'shard="1"') == 1, 10, "shard 1 reported up")
    for dsn, mine, count in ((catalog, zero, 9), (other, one, 6)):
        assert scalar(dsn, "SELECT count(*) FROM events") == count
        assert users_of(dsn, "events") == set(mine)
        assert_runs_consistent(dsn)
    assert worker.alive()


def test_a_shard_probe_waits_for_the_batch_in_flight_on_its_connection(ledger, stack, topics, monkeypatch):
    """The probe of a shard that was down asks on the shard's recorder connection, so it waits
    for the batch in flight, as the rebalance callbacks do. Before, it ran beside the recorder:
    its commit, landing between the recorder's COPY and its statement, committed the COPY
    (emptying the staging table), and the statement then moved the ledger's position past an
    event it never inserted (make chaos SEED=1 SHARDS=2: one acknowledged event lost)."""
    import asyncio
    import threading
    from concurrent.futures import Future
    from types import SimpleNamespace

    from confluent_kafka import Consumer, TopicPartition

    from vigil.ledger.partitions import PartitionKey
    from vigil.settings import load
    from vigil.worker.consumer import ConsumerLoop, InFlight
    from vigil.worker.recorder import Recorded
    from vigil.worker.settings import WorkerSettings
    from vigil.worker.shard_outage import Down

    monkeypatch.setenv("VIGIL_DATABASE_URL", ledger)
    monkeypatch.setenv("VIGIL_KAFKA_BOOTSTRAP", stack.bootstrap)
    monkeypatch.setenv("VIGIL_EVENTS_TOPIC", topics.events)
    settings = load(WorkerSettings, instance_id="prober")
    loop = ConsumerLoop(settings, SimpleNamespace(claimer=None), asyncio.new_event_loop(), None, threading.Event())
    loop.consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": f"{topics.events}.probe"})
    key = PartitionKey(topics.events, 0)
    loop.consumer.assign([TopicPartition(key.topic, key.partition, 0)])
    loop.assigned.add(key)
    loop.outages.down = {0: Down({key: 0}, probe_at=0.0)}  # shard 0 down, its probe due
    batch: Future = Future()  # the recorder's batch, still in its transaction
    loop.in_flight = InFlight(batch, {}, 0, {})
    probe = threading.Thread(target=loop._probe_down, daemon=True)
    try:
        probe.start()
        probe.join(1.0)
        assert probe.is_alive(), "the probe used the recorder's connection while its batch was in flight"
        batch.set_result(Recorded(0, []))
        probe.join(10)
        assert not probe.is_alive()
        assert loop.in_flight is None and loop.outages.down == {}  # settled, then probed: the shard answers
    finally:
        if not batch.done():
            batch.set_result(Recorded(0, []))
        probe.join(10)
        loop.consumer.close()
        loop.conns.close()
