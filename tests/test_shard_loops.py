"""The loops that work every ledger shard (issue 41): the scheduler's timers, the dispatcher's
outbox, and what ingest writes for a user, on two shards.

Two shards are two databases of the session's PostgreSQL server (tests/test_shards.py). Every
test checks that rows moved on the shard that holds them and nowhere else; a shard taken away
(its connections refused and dropped) must not stop the other's users being served.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import httpx
import psycopg
import pytest

from dispatcher_support import (
    PASS_METRIC,
    T0,
    add_message,
    add_messages,
    add_users,
    standard_webhooks_valid,
)
from embedded_ingest import EmbeddedIngest
from ingest_support import ingest_settings, make_request, read_events, stored
from scheduler_support import read_topic
from support import query, scalar, wait_for
from test_dispatcher_replicas import clock_file, receiver  # noqa: F401 (fixtures)
from test_shards import databases, shard_env  # noqa: F401 (databases: a fixture)
from vigil.clock import write_clock_file
from vigil.dispatcher.channels import new_secret
from vigil.ingest.auth import new_token, token_hash
from vigil.ledger.shardmap import ShardMap
from worker_support import metric

FAST = {"VIGIL_SCHEDULER_TICK_S": "0.2", "VIGIL_SCHEDULER_BATCH_SIZE": "25"}
PARTITIONS = 4


def users_by_shard(dsns: tuple[str, ...], per_shard: int = 2) -> dict[int, list[str]]:
    """``per_shard`` user ids homed on each shard (the rule: the migrated copies have no rows)."""
    shard_map = ShardMap(dsns)
    found: dict[int, list[str]] = {shard: [] for shard in range(len(dsns))}
    n = 0
    while any(len(users) < per_shard for users in found.values()):
        user = f"user-{n}"
        users = found[shard_map.shard_of_user(user, partitions=PARTITIONS)]
        if len(users) < per_shard:
            users.append(user)
        n += 1
    return found


def add_due_timer(dsn: str, timer_id: str, user: str) -> None:
    query(
        dsn,
        "INSERT INTO timers (id, user_id, kind, due)"
        " VALUES (%s, %s, 'followup', date_trunc('second', now()) - interval '5 seconds')",
        (timer_id, user),
    )


def fired(dsn: str) -> dict[str, int]:
    return {r["id"]: r["fired_count"] for r in query(dsn, "SELECT id, fired_count FROM timers WHERE done")}


def take_away(stack, dsn: str) -> None:
    """The shard's server gone, as its clients see it: no new connection, the open ones dropped."""
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def bring_back(stack, dsn: str) -> None:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


@pytest.fixture
def two_shards(databases, vigil_env):  # noqa: F811 (the fixture imported above)
    dsns = (databases(migrated=True), databases(migrated=True))
    env = {**vigil_env, **shard_env(*dsns, partitions=PARTITIONS)}
    return dsns, env


# -- the scheduler ---------------------------------------------------------------------------


def test_one_scheduler_fires_each_shards_due_timers_and_marks_them_on_that_shard_only(two_shards, stack, topics, spawn):
    (zero, one), env = two_shards
    homes = users_by_shard((zero, one))
    for shard, dsn in enumerate((zero, one)):
        for user in homes[shard]:
            add_due_timer(dsn, f"t-{user}", user)
    scheduler = spawn(["scheduler"], {**env, **FAST}).wait_healthy(int(env["VIGIL_SCHEDULER_PORT"]))

    wanted = {0: {f"t-{u}": 1 for u in homes[0]}, 1: {f"t-{u}": 1 for u in homes[1]}}
    wait_for(lambda: fired(zero) == wanted[0] and fired(one) == wanted[1], 30, "both shards' timers fired")
    events = read_topic(stack.bootstrap, topics.events)
    assert sorted(e.user_id for e in events) == sorted(homes[0] + homes[1])
    assert all(e.source == "timer" and e.source_id.startswith(f"t-{e.user_id}@") for e in events)
    # Each timer lives on one shard; the other never had it, and nothing was made there.
    assert scalar(zero, "SELECT count(*) FROM timers") == len(homes[0])
    assert scalar(one, "SELECT count(*) FROM timers") == len(homes[1])
    port = int(env["VIGIL_SCHEDULER_PORT"])
    assert metric(port, "vigil_scheduler_shard_up", 'shard="0"') == 1
    assert metric(port, "vigil_scheduler_shard_up", 'shard="1"') == 1
    assert scheduler.alive()


def test_one_scheduler_prunes_each_shard_and_counts_it_under_that_shard(two_shards, stack, topics, spawn):
    """Retention runs on every shard (a pruner thread each), counted under its shard: the same
    old and young rows on both (test_retention.py's), the same left on both."""
    from test_retention import KEPT, left, seed

    (zero, one), env = two_shards
    for dsn in (zero, one):
        seed(dsn)
    port = int(env["VIGIL_SCHEDULER_PORT"])
    spawn(["scheduler"], {**env, **FAST}).wait_healthy(port)
    wait_for(lambda: left(zero) == KEPT and left(one) == KEPT, 30, "both shards pruned", interval=0.2)
    for shard in ("0", "1"):
        wait_for(
            lambda shard=shard: metric(port, "vigil_ledger_pruned_rows_total", f'shard="{shard}",table="events"') == 4,
            10,
            f"shard {shard}'s prune counted under its shard",
        )


def test_a_shard_taken_away_does_not_stop_the_scheduler_serving_the_other(two_shards, stack, topics, spawn):
    (zero, one), env = two_shards
    homes = users_by_shard((zero, one), per_shard=1)
    (on_zero,), (on_one,) = homes[0], homes[1]
    port = int(env["VIGIL_SCHEDULER_PORT"])
    scheduler = spawn(["scheduler"], {**env, **FAST}).wait_healthy(port)
    add_due_timer(one, "before", on_one)
    wait_for(lambda: fired(one) == {"before": 1}, 30, "shard 1's first timer fired")

    take_away(stack, one)
    try:
        wait_for(lambda: metric(port, "vigil_scheduler_shard_up", 'shard="1"') == 0, 30, "shard 1 seen down")
        add_due_timer(zero, "during", on_zero)
        wait_for(lambda: fired(zero) == {"during": 1}, 30, "shard 0's timer fired while shard 1 is away")
        assert metric(port, "vigil_scheduler_shard_up", 'shard="0"') == 1
        assert scheduler.alive()
    finally:
        bring_back(stack, one)
    # Back: what came due on shard 1 meanwhile fires, on shard 1.
    add_due_timer(one, "after", on_one)
    wait_for(lambda: fired(one) == {"before": 1, "after": 1}, 60, "shard 1 served again")
    wait_for(lambda: metric(port, "vigil_scheduler_shard_up", 'shard="1"') == 1, 30, "shard 1 seen up")
    events = read_topic(stack.bootstrap, topics.events)
    assert sorted(e.source_id.split("@")[0] for e in events) == ["after", "before", "during"]
    assert "shard 1: pass failed" in scheduler.log()


# -- the dispatcher --------------------------------------------------------------------------


def webhook_users(catalog: str, homes: dict[int, list[str]], dsns: tuple[str, ...], url: str) -> dict[str, str]:
    """Each user's ``users`` row on their shard, their webhook channel in the catalog (shard 0,
    where channels live); returns user -> secret."""
    secrets = {}
    for shard, users in homes.items():
        add_users(dsns[shard], users)
        secrets.update({user: new_secret() for user in users})
    query(
        catalog,
        "INSERT INTO channels (user_id, type, url, secret) SELECT u, 'webhook', %s, s"
        " FROM unnest(%s::text[], %s::text[]) AS t(u, s)",
        (url, list(secrets), list(secrets.values())),
    )
    return secrets


def statuses(dsn: str) -> list[tuple[str, str]]:
    return [(r["body"], r["status"]) for r in query(dsn, "SELECT body, status FROM outbox ORDER BY id")]


def test_one_dispatcher_relays_both_shards_outboxes_and_paces_each_user_on_their_shard(
    two_shards,
    spawn,
    receiver,  # noqa: F811 (the fixture imported above)
    clock_file,  # noqa: F811
):
    (zero, one), env = two_shards
    dsns = (zero, one)
    homes = users_by_shard(dsns)
    secrets = webhook_users(zero, homes, dsns, receiver.url)
    for shard, users in homes.items():
        add_messages(dsns[shard], [(u, f"{u} first", False) for u in users], created_at=T0)
    env = {
        **env,
        "VIGIL_DISPATCHER_CLOCK_FILE": str(clock_file),
        "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.05",
        "VIGIL_OUTBOX_GAP": "3600",
    }
    port = int(env["VIGIL_DISPATCHER_PORT"])
    spawn(["dispatcher"], env).wait_healthy(port)

    everyone = homes[0] + homes[1]
    wait_for(lambda: {r.user for r in receiver.got()} == set(everyone), 30, "a delivery to every user")
    assert all(standard_webhooks_valid(secrets[r.user], r) for r in receiver.got()), "the catalog's secrets"
    for shard, users in homes.items():
        wait_for(lambda d=dsns[shard]: {s for _, s in statuses(d)} == {"delivered"}, 30, f"shard {shard} recorded")
        assert sorted(b for b, _ in statuses(dsns[shard])) == sorted(f"{u} first" for u in users)
        paced = query(dsns[shard], "SELECT user_id FROM users WHERE last_delivery_at = %s ORDER BY 1", (T0,))
        assert [r["user_id"] for r in paced] == sorted(users), "the gap restarted on the user's shard"

    # Inside the gap nothing more goes out, on either shard; past it, the held messages do.
    for shard, users in homes.items():
        add_messages(dsns[shard], [(u, f"{u} second", False) for u in users], created_at=T0)
    moment = time.time()
    wait_for(lambda: (metric(port, PASS_METRIC, 'shard="1"') or 0) > moment, 30, "a later sweep of shard 1")
    wait_for(lambda: (metric(port, PASS_METRIC, 'shard="0"') or 0) > moment, 30, "a later sweep of shard 0")
    assert len(receiver.got()) == len(everyone), "a second delivery inside a user's gap"
    write_clock_file(clock_file, (T0 + timedelta(seconds=3601)).timestamp())
    wait_for(lambda: len(receiver.got()) == 2 * len(everyone), 30, "the held messages after the gap")
    per_user = defaultdict(list)
    for r in receiver.got():
        per_user[r.user].append(r.bodies)
    assert per_user == {u: [[f"{u} first"], [f"{u} second"]] for u in everyone}
    for shard in (0, 1):
        wait_for(lambda d=dsns[shard]: {s for _, s in statuses(d)} == {"delivered"}, 30, f"shard {shard} recorded")
    assert metric(port, "vigil_dispatcher_shard_up", 'shard="1"') == 1


def test_a_shard_taken_away_does_not_stop_the_dispatcher_serving_the_other(
    two_shards,
    stack,
    spawn,
    receiver,  # noqa: F811 (the fixture imported above)
    clock_file,  # noqa: F811
):
    (zero, one), env = two_shards
    dsns = (zero, one)
    homes = users_by_shard(dsns, per_shard=1)
    (on_zero,), (on_one,) = homes[0], homes[1]
    webhook_users(zero, homes, dsns, receiver.url)
    env = {**env, "VIGIL_DISPATCHER_CLOCK_FILE": str(clock_file), "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.05"}
    port = int(env["VIGIL_DISPATCHER_PORT"])
    dispatcher = spawn(["dispatcher"], env).wait_healthy(port)
    add_message(one, on_one, "before", created_at=T0)
    wait_for(lambda: statuses(one) == [("before", "delivered")], 30, "shard 1's first message delivered")

    take_away(stack, one)
    try:
        wait_for(lambda: metric(port, "vigil_dispatcher_shard_up", 'shard="1"') == 0, 30, "shard 1 seen down")
        add_message(zero, on_zero, "during", created_at=T0)
        wait_for(lambda: statuses(zero) == [("during", "delivered")], 30, "shard 0 served while shard 1 is away")
        assert metric(port, "vigil_dispatcher_shard_up", 'shard="0"') == 1
        assert dispatcher.alive()
    finally:
        bring_back(stack, one)
    write_clock_file(clock_file, (T0 + timedelta(days=1)).timestamp())  # past the gap of "before"
    add_message(one, on_one, "after", created_at=T0)
    wait_for(lambda: statuses(one) == [("before", "delivered"), ("after", "delivered")], 60, "shard 1 served again")
    assert [r.bodies for r in receiver.got()] == [["before"], ["during"], ["after"]]
    assert "ledger error (shard 1)" in dispatcher.log()


# -- ingest ----------------------------------------------------------------------------------


def test_ingest_writes_a_users_approval_answer_timer_and_task_cancel_on_their_shard(databases, stack, topics):  # noqa: F811
    zero, one = databases(migrated=True), databases(migrated=True)
    dsns = (zero, one)
    homes = users_by_shard(dsns, per_shard=1)
    token = new_token()
    query(zero, "INSERT INTO api_tokens (id, name, token_hash) VALUES ('tok-1', 'test', %s)", (token_hash(token),))
    settings = ingest_settings(
        stack.bootstrap, zero, topics.events, ledger_shards=",".join(dsns), partitions=PARTITIONS
    )
    with (
        EmbeddedIngest(settings) as ingest,
        httpx.Client(base_url=ingest.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http,
    ):
        for shard, (user,) in homes.items():
            dsn, other = dsns[shard], dsns[1 - shard]
            # An approval answer: the request is on the user's shard, the answer is stored there.
            request_id = f"r-{user}"
            answer_token = make_request(dsn, request_id, datetime.now(UTC) + timedelta(hours=1), user_id=user)
            answered = http.post(f"/v1/approvals/{request_id}", json={"answer": "yes", "token": answer_token})
            assert answered.status_code == 200, answered.text
            assert stored(dsn, request_id)["answer"] == "yes"
            assert scalar(other, "SELECT count(*) FROM approvals WHERE user_id = %s", (user,)) == 0
            # A timer through the timers API.
            made = http.post(f"/v1/users/{user}/timers", json={"id": "digest", "every": 3600})
            assert made.status_code == 201, made.text
            assert query(dsn, "SELECT user_id, id FROM timers") == [{"user_id": user, "id": "digest"}]
            assert scalar(other, "SELECT count(*) FROM timers WHERE user_id = %s", (user,)) == 0
            assert [t["id"] for t in http.get(f"/v1/users/{user}/timers").json()["timers"]] == ["digest"]
            # A task cancel: the task is found on its user's shard and cancelled there.
            task_id = "tsk_" + str(shard) * 20
            query(
                dsn,
                "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget,"
                " max_attempts, deadline) VALUES (%s, %s, 'k', 1, ARRAY[%s], 'dig', 100, 3, now() + interval '1 h')",
                (task_id, user, user),
            )
            cancelled = http.post(f"/v1/tasks/{task_id}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
            assert scalar(dsn, "SELECT status FROM tasks") == "cancelled"
            assert scalar(other, "SELECT count(*) FROM tasks WHERE user_id = %s", (user,)) == 0
            # Tokens and the audit trail are the catalog's.
            audited = query(zero, "SELECT detail->>'task_id' AS task FROM audit WHERE action = 'task.cancel'")
            assert task_id in [row["task"] for row in audited]
        assert scalar(one, "SELECT count(*) FROM audit") == 0
    wake_ups = read_events(stack.bootstrap, topics.events, expected=2, partitions=topics.partitions)
    assert sorted(e.user_id for e in wake_ups) == sorted(homes[0] + homes[1])
