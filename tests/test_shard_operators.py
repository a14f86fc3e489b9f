"""Operators see one system over several ledger shards (issue 41, item 3): `vigil dead`,
`vigil outbox`, `vigil tasks`, `vigil approvals`, `vigil runs`, `vigil inbox`, `vigil memory`
route to a user's shard, fan lists out to every shard and merge them, and act on the shard
that holds the row.

Two shards are two databases of the session's server; a shard that does not answer is a
closed port. Every test checks which shard's rows a command read or changed.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import psycopg
import pytest

from console_support import Seeded, seed_user
from support import query
from test_operator_failures import vigil
from test_shards import databases, shard_env  # noqa: F401  (databases: a fixture)
from vigil.ledger import tasks as ledger_tasks
from vigil.ledger.db import connect_async
from vigil.partitioner import home_partition
from vigil_dev.devstack import free_port

PARTITIONS = 4


def homed(shard: int, count: int) -> list[str]:
    """Users whose home partition is on ``shard`` of two (the rule: partition % 2)."""
    names = (f"user-{n}" for n in range(1000))
    return [u for u in names if home_partition(u, PARTITIONS) % 2 == shard][:count]


def add_task(dsn: str, user: str, task_id: str) -> None:
    new = ledger_tasks.NewTaskRow(
        id=task_id,
        user_id=user,
        parent_run_key=f"{user}:1",
        parent_task_id=None,
        session_id=None,
        depth=1,
        owner_chain=[user, f"{user}:1"],
        instructions="look it up",
        tools=[],
        token_budget=1000,
        max_attempts=2,
        timeout_s=3600,
    )

    async def go():
        async with await connect_async(dsn, autocommit=True) as conn:
            await ledger_tasks.create(conn, new)

    asyncio.run(go())


class TwoShards:
    """Shard 0 holds users a and c, shard 1 user b; seeded a, b, c in that order (c newest).
    Shard 1's event ids start at 101, so its rows' ids differ from shard 0's unless a test
    makes them meet."""

    def __init__(self, make) -> None:
        self.dsns = (make(migrated=True), make(migrated=True))
        (self.a, self.c), (self.b,) = homed(0, 2), homed(1, 1)
        query(self.dsns[1], "SELECT setval('events_id_seq', 100)")
        self.seeded: dict[str, Seeded] = {}
        for user, shard in ((self.a, 0), (self.b, 1), (self.c, 0)):
            self.seeded[user] = seed_user(self.dsns[shard], user)
            query(self.dsns[shard], "UPDATE approvals SET request_id = %s WHERE request_id = 'apr-1'", (f"apr-{user}",))
            add_task(self.dsns[shard], user, f"tsk-{user}")
        self.env = shard_env(*self.dsns, partitions=PARTITIONS)

    def run(self, *args: str, env: dict[str, str] | None = None):
        return vigil(*args, env=env or self.env)


@pytest.fixture
def two(databases):  # noqa: F811  (the fixture imported above)
    return TwoShards(databases)


def lines(result) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_lists_hold_every_shards_rows_merged_newest_first(two):
    a, b, c = two.a, two.b, two.c
    dead = lines(two.run("dead", "list", "--json"))
    events = [(r["user_id"], r["shard"], r["id"]) for r in dead if r["dead"] == "event"]
    assert events == [
        (c, 0, two.seeded[c].dead_event),
        (b, 1, two.seeded[b].dead_event),
        (a, 0, two.seeded[a].dead_event),
    ]
    assert two.seeded[b].dead_event > 100  # shard 1's own row, not a copy on shard 0
    deliveries = [(r["user_id"], r["shard"]) for r in dead if r["dead"] == "delivery"]
    assert deliveries == [(c, 0), (b, 1), (a, 0)]
    # The limit is the first rows of the union: each shard's first two, merged, cut at two.
    limited = lines(two.run("dead", "list", "--json", "--limit", "2"))
    expected = [("event", c), ("event", b), ("delivery", c), ("delivery", b)]
    assert [(r["dead"], r["user_id"]) for r in limited] == expected
    text = two.run("dead", "list")
    assert text.returncode == 0 and text.stdout.splitlines()[1].split()[:2] == ["shard", "id"]

    outbox = lines(two.run("outbox", "--dead", "--json"))
    assert [(r["user_id"], r["shard"]) for r in outbox] == [(c, 0), (b, 1), (a, 0)]

    tasks = lines(two.run("tasks", "list", "--json"))
    assert [(t["id"], t["shard"]) for t in tasks] == [(f"tsk-{c}", 0), (f"tsk-{b}", 1), (f"tsk-{a}", 0)]
    assert [t["id"] for t in lines(two.run("tasks", "list", "--json", "--limit", "1"))] == [f"tsk-{c}"]

    approvals = lines(two.run("approvals", "list", "--json"))
    assert [(r["user_id"], r["shard"]) for r in approvals] == [(c, 0), (b, 1), (a, 0)]


def test_a_users_commands_read_the_users_shard(two):
    b = two.b
    inbox = lines(two.run("inbox", b, "--json"))
    assert sorted(r["id"] for r in inbox) == sorted([*two.seeded[b].events, two.seeded[b].dead_event])
    assert min(r["id"] for r in inbox) > 100  # shard 1's rows (shard 0 has no such ids)
    # One user's output is as with one shard: no "shard" field.
    assert "shard" not in inbox[0]
    assert [t["id"] for t in lines(two.run("tasks", "list", "--user", b, "--json"))] == [f"tsk-{b}"]
    assert [r["user_id"] for r in lines(two.run("approvals", "list", "--user", b, "--json"))] == [b]
    outbox = two.run("outbox", b)
    assert outbox.returncode == 0 and "reply" in outbox.stdout, outbox.stderr

    # A run key names its user; a run id counts per shard (both shards have run 1).
    key = f"{b}:900"  # a run in flight: its journal only, on its user's shard
    query(
        two.dsns[1],
        "INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body)"
        ' VALUES (%s, 1, \'call\', %s, 7, 1, \'{"name": "refund", "key": "k1"}\')',
        (key, b),
    )
    shown = json.loads(two.run("runs", "show", key, "--json").stdout)
    assert shown["run"] is None and [s["tool"] for s in shown["steps"]] == ["refund"]
    run_id = str(two.seeded[b].run_id)
    assert two.seeded[two.a].run_id == two.seeded[b].run_id
    both = two.run("runs", "show", run_id)
    assert both.returncode == 2 and "on shards 0, 1" in both.stderr and "--shard" in both.stderr
    pinned = json.loads(two.run("runs", "show", run_id, "--shard", "1", "--json").stdout)
    assert pinned["run"]["user_id"] == b


def test_actions_change_the_rows_shard_only(two):
    a, b = two.a, two.b
    ev = two.seeded[b].dead_event  # only on shard 1
    done = two.run("dead", "retry", str(ev), "--actor", "oncall", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"retried": [ev], "not_dead": []}
    assert query(two.dsns[1], "SELECT status FROM events WHERE id = %s", (ev,)) == [{"status": "pending"}]
    assert query(two.dsns[0], "SELECT count(*) AS n FROM events WHERE id = %s", (ev,)) == [{"n": 0}]
    assert query(two.dsns[0], "SELECT count(*) AS n FROM events WHERE status = 'pending'") == [{"n": 0}]

    # The same id dead on both shards: the operator must say which.
    twin = two.seeded[a].dead_event
    query(
        two.dsns[1],
        "INSERT INTO events (id, user_id, source, source_id, kind, received_at, status, attempts, finished_at, error)"
        " OVERRIDING SYSTEM VALUE VALUES (%s, %s, 'chat', 'twin', 'chat.message', now(), 'dead', 5, now(), 'x')",
        (twin, b),
    )
    both = two.run("dead", "retry", str(twin))
    assert both.returncode == 2 and f"dead event {twin} is on shards 0, 1" in both.stderr
    assert query(two.dsns[0], "SELECT status FROM events WHERE id = %s", (twin,)) == [{"status": "dead"}]
    pinned = two.run("dead", "retry", str(twin), "--shard", "1")
    assert pinned.returncode == 0 and "retried 1 event(s)" in pinned.stdout, pinned.stderr
    assert query(two.dsns[1], "SELECT status FROM events WHERE id = %s", (twin,)) == [{"status": "pending"}]
    assert query(two.dsns[0], "SELECT status FROM events WHERE id = %s", (twin,)) == [{"status": "dead"}]

    # A delivery id is a UUID: found on its shard, revived there.
    delivery = two.seeded[b].delivery_id
    revived = two.run("outbox", "--revive", delivery, "--json")
    assert revived.returncode == 0 and json.loads(revived.stdout)["user_id"] == b, revived.stderr
    assert query(two.dsns[1], "SELECT status FROM outbox WHERE delivery_id = %s", (delivery,)) == [
        {"status": "pending"}
    ]
    assert query(two.dsns[0], "SELECT count(*) AS n FROM outbox WHERE status = 'dead'") == [{"n": 2}]

    cancelled = two.run("tasks", "cancel", f"tsk-{b}", "--json")
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["status"] == "cancelled", cancelled.stderr
    assert query(two.dsns[1], "SELECT status FROM tasks") == [{"status": "cancelled"}]
    assert {r["status"] for r in query(two.dsns[0], "SELECT status FROM tasks")} == {"queued"}

    denied = two.run("approvals", "deny", f"apr-{b}")
    assert denied.returncode == 0 and b in denied.stdout, denied.stderr
    assert query(two.dsns[1], "SELECT answer FROM approvals") == [{"answer": "no"}]
    assert {r["answer"] for r in query(two.dsns[0], "SELECT answer FROM approvals")} == {None}


def test_timers_and_attention_are_the_users_shards_and_channels_the_catalogs(two):
    b = two.b
    added = two.run("timers", "add", b, "ping", "--due", "2030-01-01T00:00:00Z", "--json")
    assert added.returncode == 0, added.stderr
    assert query(two.dsns[1], "SELECT id FROM timers WHERE user_id = %s ORDER BY id", (b,)) == [
        {"id": "followup-1"},
        {"id": "ping"},
    ]
    assert query(two.dsns[0], "SELECT count(*) AS n FROM timers WHERE user_id = %s", (b,)) == [{"n": 0}]
    listed = lines(two.run("timers", "list", b, "--json"))
    assert sorted(t["id"] for t in listed) == ["followup-1", "ping"]
    # The channel is the catalog's; the attention (earned gap, deliveries) the user's shard's.
    assert two.run("channels", "set", b, "--type", "log", "--gap", "90").returncode == 0
    assert query(two.dsns[0], "SELECT gap_seconds FROM channels WHERE user_id = %s", (b,)) == [{"gap_seconds": 90}]
    shown = two.run("users", "show", b, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["gap_seconds"] == 90 and json.loads(shown.stdout)["gap_source"] == "channel"


def test_a_shard_that_does_not_answer_is_named_and_the_rest_still_listed(two):
    closed = f"postgresql://vigil@127.0.0.1:{free_port()}/vigil"
    env = shard_env(two.dsns[0], closed, partitions=PARTITIONS)
    listed = two.run("dead", "list", "--json", env=env)
    assert listed.returncode == 3
    assert "ledger shard 1 (postgresql://vigil@127.0.0.1" in listed.stderr and "not listed" in listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {(r["user_id"], r["shard"]) for r in rows} == {(two.a, 0), (two.c, 0)}
    tasks = two.run("tasks", "list", "--json", env=env)
    assert tasks.returncode == 3 and len(tasks.stdout.splitlines()) == 2 and "ledger shard 1" in tasks.stderr

    # A user on the shard that answers is served; one on the other is told which shard is down.
    assert two.run("inbox", two.a, env=env).returncode == 0
    down = two.run("inbox", two.b, env=env)
    assert down.returncode == 3 and down.stdout == ""
    assert down.stderr.count("\n") == 1 and "ledger shard 1" in down.stderr and "Traceback" not in down.stderr
    # An id found on shard 0 could be on shard 1 too: named, and --shard 0 settles it.
    run_id = str(two.seeded[two.a].run_id)
    unsure = two.run("runs", "show", run_id, env=env)
    assert unsure.returncode == 3 and "--shard 0" in unsure.stderr and "ledger shard 1" in unsure.stderr
    assert two.run("runs", "show", run_id, "--shard", "0", env=env).returncode == 0


# -- the console -----------------------------------------------------------------------------


@pytest.fixture
def console_of(two):
    """A console application in this process over ``dsns`` (shard 0: the catalog, with a token)."""
    from starlette.testclient import TestClient

    from ingest_support import create_token
    from vigil.console.app import create_app
    from vigil.console.settings import ConsoleSettings

    token = create_token(two.dsns[0], "ops-shards")["token"]
    clients = []

    def make(*dsns: str) -> TestClient:
        settings = ConsoleSettings(
            database_url=dsns[0], ledger_shards=",".join(dsns), partitions=PARTITIONS, console_auth_cache_s=0
        )
        client = TestClient(create_app(settings), base_url="http://console.test", follow_redirects=False)
        client.__enter__()
        client.headers.update({"authorization": f"Bearer {token}", "accept": "text/html"})
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def test_console_lists_every_shard_and_acts_on_the_rows_shard(two, console_of, monkeypatch):
    import vigil.console.app as console_app

    a, b, c = two.a, two.b, two.c
    console = console_of(*two.dsns)
    dead = console.get("/dead")
    assert dead.status_code == 200, dead.text
    for user, shard in ((a, 0), (b, 1), (c, 0)):
        assert f'href="/events/{two.seeded[user].dead_event}?shard={shard}"' in dead.text
        assert f'value="{shard}:{two.seeded[user].dead_event}"' in dead.text
    assert dead.text.index(f"/users/{c}") < dead.text.index(f"/users/{b}") < dead.text.index(f"/users/{a}")
    approvals = console.get("/approvals").text
    assert all(f"apr-{u}" in approvals for u in (a, b, c))
    timeline = console.get(f"/users/{b}")
    assert timeline.status_code == 200 and f'href="/events/{two.seeded[b].dead_event}?shard=1"' in timeline.text
    # Run 1 is on both shards: the first, with a banner naming the other; ?shard=1 the other's.
    run = console.get(f"/runs/{two.seeded[a].run_id}")
    assert run.status_code == 200 and f"/users/{a}" in run.text and "Shard 1 has this id too" in run.text
    assert f"/users/{b}" in console.get(f"/runs/{two.seeded[b].run_id}?shard=1").text
    # Each shard's fencing row for its partition (the page lists the ledger's rows, and the
    # broker's when it answers: here no broker is asked for, so the rows must be the ledger's).
    for shard, dsn in enumerate(two.dsns):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO partitions (topic, partition, epoch, holder) VALUES ('vigil.events', %s, 1, 'w')",
                (shard,),
            )
    parts = console.get("/partitions")
    assert parts.status_code == 200 and "<th>shard</th>" in parts.text

    # A page of two rows at a time: the cursor holds a keyset per shard, nothing skipped or repeated.
    monkeypatch.setattr(console_app, "PAGE", 2)
    first = console.get("/dead").text
    assert f"/users/{c}" in first and f"/users/{b}" in first and f"/users/{a}" not in first.split("Dead deliveries")[0]
    nxt = re.search(r'href="/dead\?events_before=([^"]+)"', first).group(1)
    second = console.get(f"/dead?events_before={nxt}").text.split("Dead deliveries")[0]
    assert f"/users/{a}" in second and f"/users/{b}" not in second and f"/users/{c}" not in second
    monkeypatch.undo()

    # Retry shard 1's dead event (its id taken on shard 0 too): shard 1 changes, shard 0 not.
    ev = two.seeded[b].dead_event
    query(
        two.dsns[0],
        "INSERT INTO events (id, user_id, source, source_id, kind, received_at, status, attempts, finished_at, error)"
        " OVERRIDING SYSTEM VALUE VALUES (%s, %s, 'chat', 'twin', 'chat.message', now(), 'dead', 5, now(), 'x')",
        (ev, a),
    )
    done = console.post("/dead/events/retry", data={"event_id": f"1:{ev}"})
    assert done.status_code == 303 and "retried=1%3A" in done.headers["location"], done.text
    assert query(two.dsns[1], "SELECT status FROM events WHERE id = %s", (ev,)) == [{"status": "pending"}]
    assert query(two.dsns[0], "SELECT status FROM events WHERE id = %s", (ev,)) == [{"status": "dead"}]
    delivery = two.seeded[b].delivery_id
    revived = console.post(f"/deliveries/{delivery}/revive")
    assert revived.status_code == 303 and revived.headers["location"].endswith("?shard=1&revived=1")
    assert query(two.dsns[1], "SELECT status FROM outbox WHERE delivery_id = %s", (delivery,)) == [
        {"status": "pending"}
    ]


def test_console_names_a_shard_that_does_not_answer_and_shows_the_rest(two, console_of):
    closed = f"postgresql://vigil@127.0.0.1:{free_port()}/vigil"
    console = console_of(two.dsns[0], closed)
    banner = "Ledger shard 1 (postgresql://vigil@127.0.0.1"
    took = {}
    for path in ("/", "/dead", "/approvals", "/timers", "/partitions"):
        began = time.monotonic()
        page = console.get(path)
        took[path] = time.monotonic() - began
        assert page.status_code == 200 and banner in page.text, (path, page.status_code, page.text[:300])
    # The first page waited for the down shard's pool; the next ones, within DOWN_HOLD_S of
    # it, answer with the banner at once instead of waiting the pool's timeout each (5 s).
    assert max(took[p] for p in ("/dead", "/approvals", "/timers")) < 2.5, took
    dead = console.get("/dead").text
    assert f"/users/{two.a}" in dead and f"/users/{two.c}" in dead and f"/users/{two.b}" not in dead
    assert console.get(f"/users/{two.a}").status_code == 200
    down = console.get(f"/users/{two.b}")
    assert down.status_code == 503 and "ledger shard 1" in down.text
