"""`vigil shards move` (issue 41, item 4): a partition's users move from one shard to another,
every per-user table, then the catalog's map names the target.

Two shards are two databases of the session's server (test_shards.py). Partition 1 of 4 lives
on shard 1 by the rule; its users are moved to shard 0. Partition 3 (also on shard 1) and
partition 0 (on shard 0) are the bystanders whose rows must not change.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import psycopg
import pytest

from support import query
from test_operator_failures import assert_one_line, vigil
from test_shards import databases, shard_env  # noqa: F401  (the fixture)
from vigil.ledger import shardmove
from vigil.ledger.claims import claim
from vigil.ledger.db import connect, connect_async
from vigil.ledger.partitions import PartitionKey, lock_epochs, take_over
from vigil.partitioner import home_partition
from vigil.settings import DEFAULT_EVENTS_TOPIC as TOPIC

PARTITIONS = 4
MOVED, STAYS, ELSEWHERE = 1, 3, 0  # partitions 1 and 3 on shard 1, 0 on shard 0


def users_of(partition: int, count: int) -> list[str]:
    found = [u for u in (f"user-{n}" for n in range(200)) if home_partition(u, PARTITIONS) == partition]
    return found[:count]


SEED = [
    "INSERT INTO users (user_id, home_topic, home_partition) VALUES (%(u)s, %(topic)s, %(p)s)",
    "INSERT INTO event_keys (user_id, source, source_id) VALUES (%(u)s, 'api', 'e1'), (%(u)s, 'api', 'e2')",
    "INSERT INTO events (user_id, source, source_id, kind, received_at) VALUES (%(u)s, 'api', 'e1', 'message', now())",
    "INSERT INTO events (user_id, source, source_id, kind, received_at, status, finished_at)"
    " VALUES (%(u)s, 'api', 'e2', 'message', now(), 'done', now())",
    "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome)"
    " VALUES (%(u)s, %(topic)s, %(p)s, 1, 'w1', '{}', now(), now(), 'message')",
    "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body)"
    " VALUES (%(u)s || ':1', 1, 'model', %(u)s, 1, 1, '{}')",
    "INSERT INTO outbox (user_id, run_id, epoch, body) SELECT %(u)s, max(id), 1, 'hi' FROM runs WHERE user_id = %(u)s",
    "INSERT INTO timers (id, user_id, kind, due) VALUES ('t1', %(u)s, 'followup', date_trunc('second', now()))",
    "INSERT INTO sessions (id, user_id) VALUES ('s-' || %(u)s, %(u)s)",
    "INSERT INTO memory (user_id, path, content) VALUES (%(u)s, '/memories/a.md', 'x')",
    "INSERT INTO memory_history (user_id, path, new_content) VALUES (%(u)s, '/memories/a.md', 'x')",
    "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, token_budget, max_attempts,"
    " deadline) VALUES ('tsk_' || %(u)s, %(u)s, %(u)s || ':1', 1, ARRAY[%(u)s], 'do', 1000, 3, now() + interval '1h')",
    "INSERT INTO approvals (request_id, user_id, session_id, tool, args_hash, due)"
    " VALUES ('req-' || %(u)s, %(u)s, 's-' || %(u)s, 'refund', 'h', now() + interval '1h')",
    "INSERT INTO budget_notices (user_id, day, profile) VALUES (%(u)s, current_date, 'default')",
    "INSERT INTO refunds (idempotency_key, user_id, order_id, amount) VALUES ('k-' || %(u)s, %(u)s, 'o1', 5)",
]
# Rows each seeded user has, per table.
PER_USER = {t: 1 for t in shardmove.USER_TABLES} | {"event_keys": 2, "events": 2}


def seed(dsn: str, partition: int, users: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for u in users:
            for statement in SEED:
                conn.execute(statement, {"u": u, "p": partition, "topic": TOPIC})
        conn.execute(
            "INSERT INTO partitions (topic, partition, epoch, holder) VALUES (%s, %s, 3, 'worker-a')",
            (TOPIC, partition),
        )
        conn.execute(
            "INSERT INTO consumer_positions (topic, partition, next_offset) VALUES (%s, %s, 42)", (TOPIC, partition)
        )


def rows_of(dsn: str, users: list[str]) -> dict[str, int]:
    """Rows of ``users`` per per-user table on a shard."""
    return {
        t: query(dsn, f"SELECT count(*) AS n FROM {t} WHERE user_id = ANY(%s)", (users,))[0]["n"]
        for t in shardmove.USER_TABLES
    }


def snapshot(dsn: str, users: list[str]) -> list[str]:
    """Every row of ``users``, as text, sorted: equal snapshots are the same rows."""
    return sorted(
        r["t"]
        for t in shardmove.USER_TABLES
        for r in query(dsn, f"SELECT {t}::text AS t FROM {t} WHERE user_id = ANY(%s)", (users,))
    )


@pytest.fixture
def two_shards(databases):  # noqa: F811  (the fixture imported above)
    catalog, other = databases(migrated=True), databases(migrated=True)
    env = shard_env(catalog, other, partitions=PARTITIONS)
    assert vigil("migrate", env=env).returncode == 0
    people = {MOVED: users_of(MOVED, 3), STAYS: users_of(STAYS, 2), ELSEWHERE: users_of(ELSEWHERE, 2)}
    seed(other, MOVED, people[MOVED])
    seed(other, STAYS, people[STAYS])
    seed(catalog, ELSEWHERE, people[ELSEWHERE])
    return catalog, other, env, people


def listed(env: dict[str, str]) -> dict[int, list[int]]:
    result = vigil("shards", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return {s["shard"]: s["partitions"] for s in json.loads(result.stdout)["shards"]}


def assert_moved(catalog: str, other: str, env: dict[str, str], people: dict[int, list[str]], before: dict) -> None:
    moved = people[MOVED]
    assert rows_of(catalog, moved) == {t: n * len(moved) for t, n in PER_USER.items()}
    assert set(rows_of(other, moved).values()) == {0}, "nothing of the moved users is left on the source"
    assert snapshot(catalog, moved) == before["moved"], "the rows arrived as they were, ids included"
    assert snapshot(other, people[STAYS]) == before["stays"] and snapshot(catalog, people[ELSEWHERE]) == before["else"]
    position = "SELECT next_offset FROM consumer_positions WHERE partition = %s"
    assert [r["next_offset"] for r in query(catalog, position, (MOVED,))] == [42]
    assert query(other, position, (MOVED,)) == [] and query(other, position, (STAYS,))[0]["next_offset"] == 42
    assert listed(env) == {0: [0, 1, 2], 1: [3]}
    assert query(catalog, "SELECT state FROM shard_moves WHERE partition = %s", (MOVED,))[0]["state"] == "done"
    # A new row on the target takes an id past every copied one.
    top = query(catalog, "SELECT max(id) AS m FROM events")[0]["m"]
    new = query(
        catalog,
        "INSERT INTO events (user_id, source, source_id, kind, received_at) VALUES "
        "('x', 'api', 'new', 'm', now()) RETURNING id",
    )[0]["id"]
    assert new > top >= 10**15


def before_of(catalog: str, other: str, people: dict[int, list[str]]) -> dict:
    return {
        "moved": snapshot(other, people[MOVED]),
        "stays": snapshot(other, people[STAYS]),
        "else": snapshot(catalog, people[ELSEWHERE]),
    }


def test_a_dry_run_prints_the_rows_per_table_and_changes_nothing(two_shards):
    catalog, other, env, people = two_shards
    before = before_of(catalog, other, people)
    dry = vigil("shards", "move", str(MOVED), "--to", "0", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0] == f"partition {MOVED}: shard 1 -> shard 0, 3 user(s)"
    assert lines[-1] == "dry run: nothing changed"
    counts = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert counts["events"] == ["6", "0"] and counts["event_keys"] == ["6", "0"] and counts["outbox"] == ["3", "0"]
    assert counts["consumer_positions"] == ["1", "0"] and set(counts) == set(shardmove.TABLES)

    as_json = json.loads(vigil("shards", "move", str(MOVED), "--to", "0", "--dry-run", "--json", env=env).stdout)
    assert {t["table"]: t["source_rows"] for t in as_json["tables"]} == {
        "consumer_positions": 1,
        **{t: n * 3 for t, n in PER_USER.items()},
    }
    assert before_of(catalog, other, people) == before
    assert listed(env) == {0: [0, 2], 1: [1, 3]}
    assert query(catalog, "SELECT count(*) AS n FROM shard_moves")[0]["n"] == 0
    assert query(other, "SELECT epoch FROM partitions WHERE partition = %s", (MOVED,))[0]["epoch"] == 3


def test_a_move_takes_every_row_and_flips_the_map(two_shards):
    catalog, other, env, people = two_shards
    before = before_of(catalog, other, people)
    done = vigil("shards", "move", str(MOVED), "--to", "0", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"partition {MOVED}: moved 3 user(s) from shard 1 to shard 0"
    assert_moved(catalog, other, env, people, before)
    # The fence: the source's row stays past the owner's epoch, the target's starts from it.
    epochs = "SELECT epoch, holder FROM partitions WHERE partition = %s"
    assert query(other, epochs, (MOVED,)) == [{"epoch": 4, "holder": "vigil shards move"}]
    assert query(catalog, epochs, (MOVED,)) == [{"epoch": 4, "holder": "vigil shards move"}]

    again = vigil("shards", "move", str(MOVED), "--to", "0", env=env)
    assert again.returncode == 0 and again.stdout.strip() == f"partition {MOVED} is already on shard 0: nothing to move"


@pytest.mark.parametrize("step", ["copied events", "copied outbox", "verified", "flipped", "deleted runs"])
def test_an_interrupted_move_completes_when_run_again(two_shards, step):
    catalog, other, env, people = two_shards
    before = before_of(catalog, other, people)

    def crash(at: str) -> None:
        if at == step:
            raise RuntimeError(f"interrupted after {at}")

    with pytest.raises(RuntimeError, match="interrupted"):
        shardmove.move((catalog, other), partition=MOVED, target=0, partitions=PARTITIONS, topic=TOPIC, on_step=crash)
    flipped = step in ("flipped", "deleted runs")
    assert listed(env) == ({0: [0, 1, 2], 1: [3]} if flipped else {0: [0, 2], 1: [1, 3]})
    # Another target is refused while this move is in progress.
    other_way = vigil("shards", "move", str(MOVED), "--to", "1", env=env)
    assert_one_line(other_way, 4, "being moved to shard 0", f"vigil shards move {MOVED} --to 0")

    resumed = vigil("shards", "move", str(MOVED), "--to", "0", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert_moved(catalog, other, env, people, before)


def test_a_row_changed_on_the_source_after_an_interrupted_copy_is_copied_again(two_shards):
    catalog, other, env, people = two_shards

    def crash(at: str) -> None:
        if at == "copied refunds":
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        shardmove.move((catalog, other), partition=MOVED, target=0, partitions=PARTITIONS, topic=TOPIC, on_step=crash)
    # A dispatcher that was not stopped delivers one of the copied outbox rows on the source.
    with psycopg.connect(other, autocommit=True) as conn:
        conn.execute("UPDATE outbox SET body = 'changed' WHERE user_id = %s", (people[MOVED][0],))
    before = before_of(catalog, other, people)
    assert vigil("shards", "move", str(MOVED), "--to", "0", env=env).returncode == 0
    assert_moved(catalog, other, env, people, before)
    assert query(catalog, "SELECT body FROM outbox WHERE user_id = %s", (people[MOVED][0],))[0]["body"] == "changed"


def test_a_live_owner_can_neither_claim_nor_finish_after_the_fence(two_shards):
    catalog, other, env, people = two_shards
    key = PartitionKey(TOPIC, MOVED)
    with connect(other, autocommit=True) as conn, conn.transaction():
        owner_epoch = take_over(conn, key, "worker-b")
    # The owner claimed one user's event before the move began.
    with psycopg.connect(other, autocommit=True) as conn:
        conn.execute(
            "UPDATE events SET status = 'running', claim_epoch = %s, attempts = 1 WHERE user_id = %s"
            " AND status = 'pending'",
            (owner_epoch, people[MOVED][0]),
        )

    def stop(at: str) -> None:
        if at == "fenced":
            raise RuntimeError("stopped after the fence")

    with pytest.raises(RuntimeError):
        shardmove.move((catalog, other), partition=MOVED, target=0, partitions=PARTITIONS, topic=TOPIC, on_step=stop)

    async def owner() -> tuple[dict, list]:
        conn = await connect_async(other, autocommit=True)
        async with conn:
            epochs = await lock_epochs(conn, [key])  # the finish's check of its claim's epoch
            claims, _ = await claim(
                conn, owned={key: owner_epoch}, busy=[], max_users=10, batch_max=10, window_s=0, max_attempts=5
            )
        return epochs, claims

    epochs, claims = asyncio.run(owner())
    assert epochs[key] == owner_epoch + 1, "the finish sees an epoch that is not its claim's: it writes nothing"
    assert claims == [], "no claim under the old epoch"
    assert vigil("shards", "move", str(MOVED), "--to", "0", env=env).returncode == 0
    # The running event arrives as it was; the target's owner hands it back at its takeover.
    running = "SELECT status, claim_epoch FROM events WHERE user_id = %s AND source_id = 'e1'"
    assert query(catalog, running, (people[MOVED][0],)) == [{"status": "running", "claim_epoch": owner_epoch}]


def test_unknown_names_and_a_dead_shard_are_one_line(two_shards, databases):  # noqa: F811
    catalog, other, env, _ = two_shards
    assert_one_line(vigil("shards", "move", "1", "--to", "5", env=env), 2, "unknown shard 5", "VIGIL_LEDGER_SHARDS")
    assert_one_line(vigil("shards", "move", "9", "--to", "0", env=env), 2, "unknown partition 9", "VIGIL_PARTITIONS")
    closed = "postgresql://vigil:hidden@127.0.0.1:1/vigil"
    dead = vigil("shards", "move", "2", "--to", "2", env=shard_env(catalog, other, closed, partitions=PARTITIONS))
    assert_one_line(dead, 3, "ledger shard 2", "unreachable")
    assert "hidden" not in dead.stderr


def test_a_move_killed_mid_copy_completes_when_run_again(two_shards):
    """The command itself, SIGKILLed as soon as it says it copied the events."""
    catalog, other, env, people = two_shards
    before = before_of(catalog, other, people)
    command = [sys.executable, "-m", "vigil", "shards", "move", str(MOVED), "--to", "0"]
    proc = subprocess.Popen(
        command, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == f"partition {MOVED}: copied events":
            proc.send_signal(signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert query(catalog, "SELECT state FROM shard_moves WHERE partition = %s", (MOVED,))[0]["state"] == "copying"
    assert listed(env) == {0: [0, 2], 1: [1, 3]}, "killed before the flip: the source still holds the partition"

    resumed = vigil("shards", "move", str(MOVED), "--to", "0", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert_moved(catalog, other, env, people, before)


def test_migrate_starts_each_shards_ids_apart_and_a_collision_stops_the_move(two_shards):
    catalog, other, env, people = two_shards
    # Ids are copied as they are: `vigil migrate` started shard 1's sequences at 10**15.
    for table in shardmove.IDENTITY_TABLES:
        low = query(other, f"SELECT min(id) AS m FROM {table}")[0]["m"]
        high = query(catalog, f"SELECT max(id) AS m FROM {table}")[0]["m"]
        assert low >= 10**15 > high, table
    # A shard whose sequences were in use before (ids overlapping): the move stops, naming the table.
    taken = query(other, "SELECT min(id) AS id FROM outbox WHERE user_id = ANY(%s)", (people[MOVED],))[0]["id"]
    query(
        catalog,
        "INSERT INTO outbox (id, user_id, run_id, epoch, body) OVERRIDING SYSTEM VALUE"
        " VALUES (%s, 'someone', 1, 1, 'x') RETURNING id",
        (taken,),
    )
    refused = vigil("shards", "move", str(MOVED), "--to", "0", env=env)
    assert_one_line(refused, 4, "outbox", "ids the target already gives other users")
    assert listed(env) == {0: [0, 2], 1: [1, 3]}, "nothing flipped"
    assert rows_of(other, people[MOVED])["outbox"] == 3, "nothing deleted from the source"
