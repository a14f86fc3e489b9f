"""The ledger's shards (issue 41, its foundation): the shard map, `vigil migrate` on every
shard, `vigil shards`, and VIGIL_LEDGER_SHARDS refused at start-up when it is wrong.

Two shards are two databases of the session's PostgreSQL server (a shard is a DSN; whether two
DSNs share a server changes nothing here); an unreachable shard is a closed port.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from support import query
from test_operator_failures import assert_one_line, vigil
from vigil.ledger.migrate import discover
from vigil.ledger.shardmap import ShardMap, ShardMapError, rule, shown_dsn
from vigil.ledger.shardpools import AsyncShardPools, ShardRoutes, SyncShardPools
from vigil.partitioner import java_partition
from vigil.settings import CommonSettings, SettingsError, load
from vigil_dev.devstack import free_port

# -- the map's rule (pure) -----------------------------------------------------------------


def test_rule_is_the_partition_modulo_the_shard_count():
    assert [rule(p, shards=1) for p in range(6)] == [0] * 6
    assert [rule(p, shards=2) for p in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [rule(p, shards=3) for p in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    # A grown topic: a new partition's shard needs no knowledge of the partition count.
    assert rule(97, shards=4) == 1
    with pytest.raises(ValueError):
        rule(-1, shards=2)


def test_the_catalogs_rows_win_over_the_rule():
    dsns = ("postgresql://vigil@a/vigil", "postgresql://vigil@b/vigil")
    plain = ShardMap(dsns)
    assert plain.shard_of(3) == 1 and plain.partitions_of(1, partitions=6) == [1, 3, 5]
    # Partition 3 was moved to shard 0, and the rows say where every partition lives.
    moved = ShardMap(dsns, assigned={0: 0, 1: 1, 2: 0, 3: 0})
    assert moved.shard_of(3) == 0 and moved.shard_of(5) == 1  # 5 has no row: the rule
    assert moved.partitions_of(0, partitions=6) == [0, 2, 3, 4]
    assert moved.partitions_of(1, partitions=6) == [1, 5]
    # A row past the topic's configured count is listed too (a topic grown past VIGIL_PARTITIONS).
    assert ShardMap(dsns, assigned={9: 1}).partitions_of(1, partitions=4) == [1, 3, 9]


def test_a_user_lives_on_the_shard_of_their_home_partition():
    dsns = ("postgresql://vigil@a/vigil", "postgresql://vigil@b/vigil")
    # java_partition is checked against Kafka's own client in test_partitioner.py.
    homes = {user: java_partition(user.encode(), 12) for user in ("alice", "bob", "carol", "dave")}
    assert {homes[u] % 2 for u in homes} == {0, 1}, "the sample spans both shards"
    plain = ShardMap(dsns)
    assert {u: plain.shard_of_user(u, partitions=12) for u in homes} == {u: p % 2 for u, p in homes.items()}
    moved = ShardMap(dsns, assigned={homes["alice"]: 1 - homes["alice"] % 2})
    assert moved.shard_of_user("alice", partitions=12) == 1 - homes["alice"] % 2
    assert moved.dsn_of(homes["alice"]) == dsns[1 - homes["alice"] % 2]


def test_a_row_naming_a_shard_that_is_not_configured_is_an_error():
    with pytest.raises(ShardMapError, match="partition 4 on shard 2, .* lists 2 shards"):
        ShardMap(("postgresql://a/v", "postgresql://b/v"), assigned={4: 2})


def test_one_shard_by_default_is_the_database_url():
    settings = CommonSettings(database_url="postgresql://vigil:pw@db:5432/vigil")
    assert settings.shard_dsns == ("postgresql://vigil:pw@db:5432/vigil",)
    assert ShardMap(settings.shard_dsns).partitions_of(0, partitions=3) == [0, 1, 2]


# -- the routes and the pools (vigil.ledger.shardpools) ---------------------------------------


def test_one_shard_routes_to_the_catalog_without_reading_a_map():
    closed = f"postgresql://vigil@127.0.0.1:{free_port()}/vigil"  # nothing listens: a read would fail
    routes = ShardRoutes((closed,), partitions=12, connect_timeout=1)
    assert routes.single and routes.loaded and routes.count == 1
    assert routes.shard_of(7) == 0 and routes.shard_of_user("alice") == 0


def test_several_shards_read_the_catalogs_map_on_first_need_and_again_after_a_failure(databases):
    dsns = (databases(migrated=True), databases(migrated=True))
    with psycopg.connect(dsns[0], autocommit=True) as conn:
        conn.execute("DELETE FROM shard_map")
        conn.execute("INSERT INTO shard_map (partition, shard) VALUES (3, 0)")
    down = (f"postgresql://vigil@127.0.0.1:{free_port()}/vigil", dsns[1])
    routes = ShardRoutes(down, partitions=6, connect_timeout=1)
    assert not routes.loaded
    with pytest.raises(psycopg.OperationalError):
        routes.shard_of(3)
    routes.dsns = dsns  # the catalog answers now: the next lookup reads it
    assert routes.shard_of(3) == 0 and routes.shard_of(5) == 1 and routes.loaded
    with psycopg.connect(dsns[0], autocommit=True) as conn:
        conn.execute("UPDATE shard_map SET shard = 1 WHERE partition = 3")
    assert routes.shard_of(3) == 0, "read once: a lookup does not read the catalog"
    routes.reload()
    assert routes.shard_of(3) == 1


class FakePool:
    def __init__(self, name):
        self.name, self.opened, self.closed = name, 0, 0

    def open(self, wait):
        assert wait is False  # a shard that does not answer yet fails statements, not its opener
        self.opened += 1

    def close(self):
        self.closed += 1


class FakeAsyncPool(FakePool):
    async def open(self, wait):
        FakePool.open(self, wait)

    async def close(self):
        FakePool.close(self)


def test_a_shards_pool_is_made_and_opened_once_and_the_catalogs_left_to_its_opener():
    routes = ShardRoutes(("postgresql://a/v", "postgresql://b/v", "postgresql://c/v"), partitions=6)
    made = []
    catalog = FakePool("catalog")
    pools = SyncShardPools(routes, catalog, lambda dsn, shard: made.append(FakePool(dsn)) or made[-1])  # type: ignore[arg-type]
    assert pools.get(2) is None and pools.open(0) is catalog
    assert pools.open(2) is pools.open(2) is made[0] and made[0].name == "postgresql://c/v" and made[0].opened == 1
    assert [shard for shard, _ in pools.opened()] == [0, 2]
    pools.close(catalog=False)
    assert made[0].closed == 1 and catalog.closed == 0


def test_the_async_pools_too_and_closing_every_one_closes_the_catalogs_last():
    routes = ShardRoutes(("postgresql://a/v", "postgresql://b/v"), partitions=6)
    closed = []

    class Recorded(FakeAsyncPool):
        async def close(self):
            closed.append(self.name)

    async def scenario():
        pools = AsyncShardPools(routes, Recorded("catalog"), lambda dsn, shard: Recorded(dsn))  # type: ignore[arg-type]
        other = await pools.open(1)
        assert await pools.open(1) is other and other.opened == 1
        await pools.close(catalog=True)

    asyncio.run(scenario())
    assert closed == ["postgresql://b/v", "catalog"]


def test_shown_dsn_drops_the_password():
    assert shown_dsn("postgresql://vigil:s3cret@10.0.0.5:5433/ledger") == "postgresql://vigil@10.0.0.5:5433/ledger"
    assert "s3cret" not in shown_dsn("host=db port=5432 dbname=vigil user=vigil password=s3cret")


# -- VIGIL_LEDGER_SHARDS at start-up ---------------------------------------------------------

CATALOG = "postgresql://vigil:pw@db0:5432/vigil"


@pytest.mark.parametrize(
    ("shards", "words"),
    [
        (f"{CATALOG},mysql://db1/vigil", ["not a postgresql:// URL", "entry 1"]),
        (f"{CATALOG},,postgresql://vigil:pw@db2/vigil", ["entry 1 is empty"]),
        (f"{CATALOG},postgresql://vigil:pw@[db1/vigil", ["entry 1 is not a valid PostgreSQL URL"]),
        (f"{CATALOG},postgresql://admin:other@db0:5432/vigil", ["entries 0 and 1", "same database"]),
        ("postgresql://vigil:pw@db9:5432/vigil,postgresql://vigil:pw@db1/vigil", ["catalog", "VIGIL_DATABASE_URL"]),
    ],
    ids=["scheme", "empty-entry", "malformed", "duplicate", "catalog-elsewhere"],
)
def test_a_bad_ledger_shards_setting_is_refused_naming_it(shards, words):
    with pytest.raises(SettingsError) as refused:
        load(CommonSettings, database_url=CATALOG, ledger_shards=shards)
    message = str(refused.value)
    assert "VIGIL_LEDGER_SHARDS" in message and "pw" not in message and "other" not in message, message
    for word in words:
        assert word in message, message


def test_more_shards_than_partitions_is_refused():
    shards = ",".join([CATALOG, "postgresql://vigil:pw@db1/vigil", "postgresql://vigil:pw@db2/vigil"])
    with pytest.raises(SettingsError, match="VIGIL_LEDGER_SHARDS.*3 shards.*VIGIL_PARTITIONS=2"):
        load(CommonSettings, database_url=CATALOG, ledger_shards=shards, partitions=2)


def test_a_bad_ledger_shards_is_one_line_and_exit_2_for_every_command():
    env = {"VIGIL_DATABASE_URL": CATALOG, "VIGIL_LEDGER_SHARDS": f"{CATALOG},postgresql://vigil:pw@db1/vigil,"}
    for args in (["migrate", "--check"], ["shards"], ["worker"]):
        line = assert_one_line(vigil(*args, env=env), 2, "VIGIL_LEDGER_SHARDS", "entry 2 is empty")
        assert ":pw@" not in line


def test_every_service_checks_every_shards_schema_at_start(databases):
    """Started on two shards, a service refuses a shard whose schema is behind, naming it."""
    catalog, behind = databases(migrated=True), databases()
    env = {**shard_env(catalog, behind), "VIGIL_APPROVAL_SECRET": "s" * 43}
    for service in ("worker", "scheduler", "dispatcher", "ingest"):
        line = assert_one_line(vigil(service, env=env), 2, "ledger shard 1's schema is behind", "vigil migrate")
        assert "shard 0" not in line


# -- migrate and shards on two shards ---------------------------------------------------------


def _database(stack, template: str | None = None) -> str:
    name = f"vigil_shard_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        stack.create_database(conn, name, template)
    return name


@pytest.fixture
def databases(stack):
    """Make databases on the session's server (empty, or copies of the migrated template); dropped at the end."""
    made: list[str] = []

    def make(migrated: bool = False) -> str:
        made.append(_database(stack, stack.template if migrated else None))
        return as_url(stack.dsn(made[-1]))

    yield make
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        for name in made:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def as_url(dsn: str) -> str:
    """VIGIL_LEDGER_SHARDS takes URLs (a key=value DSN may hold a comma)."""
    p = conninfo_to_dict(dsn)
    return f"postgresql://{p['user']}:{p['password']}@{p['host']}:{p['port']}/{p['dbname']}"


def shard_env(*dsns: str, partitions: int = 4) -> dict[str, str]:
    return {"VIGIL_DATABASE_URL": dsns[0], "VIGIL_LEDGER_SHARDS": ",".join(dsns), "VIGIL_PARTITIONS": str(partitions)}


def test_migrate_covers_every_shard_then_check_names_the_shard_behind(databases):
    catalog, other = databases(), databases()
    env = shard_env(catalog, other)
    behind = vigil("migrate", "--check", "--json", env=env)
    assert behind.returncode == 1, behind.stderr
    report = json.loads(behind.stdout)
    assert report["up_to_date"] is False and [s["shard"] for s in report["shards"]] == [0, 1]
    assert all(s["pending"][0].startswith("0001_") for s in report["shards"])

    applied = vigil("migrate", "--json", env=env)
    assert applied.returncode == 0, applied.stderr
    done = json.loads(applied.stdout)
    assert done["applied"] == report["shards"][0]["pending"]  # the catalog's, as with one shard
    assert [s["applied"] for s in done["shards"]] == [report["shards"][0]["pending"]] * 2
    assert done["shard_map_seeded"] == 4
    # The full schema on both; the map's rows in the catalog only, seeded from the rule.
    rows = query(catalog, "SELECT partition, shard FROM shard_map ORDER BY partition")
    assert [(r["partition"], r["shard"]) for r in rows] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert query(other, "SELECT count(*) AS n FROM shard_map")[0]["n"] == 0
    assert query(other, "SELECT to_regclass('events_live') AS t")[0]["t"] == "events_live"

    ok = vigil("migrate", "--check", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines() == [
        f"shard 0 {shown_dsn(catalog)}: up to date",
        f"shard 1 {shown_dsn(other)}: up to date",
    ]

    # Shard 1 loses its newest migration's record: --check fails and says which shard.
    with psycopg.connect(other, autocommit=True) as conn:
        newest = conn.execute(
            "DELETE FROM schema_migrations WHERE version = (SELECT max(version) FROM "
            "schema_migrations) RETURNING version, name"
        ).fetchone()
    one_behind = vigil("migrate", "--check", env=env)
    assert one_behind.returncode == 1
    assert f"shard 0 {shown_dsn(catalog)}: up to date" in one_behind.stdout
    assert f"shard 1 {shown_dsn(other)}: behind, 1 pending ({newest[0]:04d}_{newest[1]})" in one_behind.stdout
    assert "password" not in one_behind.stdout and "@" in one_behind.stdout


def test_migrate_on_one_shard_prints_what_it_always_printed(databases):
    env = {"VIGIL_DATABASE_URL": databases(), "VIGIL_PARTITIONS": "3"}
    assert vigil("migrate", env=env).returncode == 0
    assert vigil("migrate", env=env).stdout.strip() == "ledger is up to date"
    assert vigil("migrate", "--check", env=env).stdout.strip() == "ledger is up to date"
    # One shard: every partition's row says shard 0, so adding a shard later moves nobody by itself.
    assert query(env["VIGIL_DATABASE_URL"], "SELECT array_agg(shard ORDER BY partition) AS s FROM shard_map")[0][
        "s"
    ] == [0, 0, 0]


def test_shards_lists_each_shard_and_an_unreachable_one_fails_the_command(databases):
    catalog, other = databases(migrated=True), databases(migrated=True)
    closed = f"postgresql://vigil:hidden@127.0.0.1:{free_port()}/vigil"
    assert vigil("migrate", env=shard_env(catalog, other, partitions=6)).returncode == 0
    with psycopg.connect(other, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO events (user_id, source, source_id, kind, received_at)"
            " SELECT 'ann', 'api', 'e' || n, 'message', now() FROM generate_series(1, 3) n"
        )
        conn.execute("INSERT INTO outbox (user_id, run_id, epoch, body) VALUES ('ann', 1, 1, 'hi')")

    two = vigil("shards", "--json", env=shard_env(catalog, other, partitions=6))
    assert two.returncode == 0, two.stderr
    listed = json.loads(two.stdout)
    assert listed["map"] == "catalog"
    shards = listed["shards"]
    assert [(s["shard"], s["dsn"], s["partitions"]) for s in shards] == [
        (0, shown_dsn(catalog), [0, 2, 4]),
        (1, shown_dsn(other), [1, 3, 5]),
    ]
    for s in shards:
        assert s["reachable"] is True and s["error"] is None and s["pending"] == [], s
        assert s["schema_version"] == discover()[-1].version
    assert (shards[0]["events_waiting"], shards[0]["outbox_pending"]) == (0, 0)
    assert (shards[1]["events_waiting"], shards[1]["outbox_pending"]) == (3, 1)

    # A third shard on a closed port: the others are still listed, the command exits 3.
    three = vigil("shards", "--json", env=shard_env(catalog, other, closed, partitions=6))
    assert three.returncode == 3, three.stderr
    shards = json.loads(three.stdout)["shards"]
    assert [s["reachable"] for s in shards] == [True, True, False]
    assert shards[2]["dsn"] == shown_dsn(closed) and "hidden" not in three.stdout + three.stderr
    assert "refused" in shards[2]["error"] and shards[2]["schema_version"] is None
    # The catalog's rows were seeded for two shards: a shard added later holds nothing until
    # partitions are moved to it.
    assert shards[2]["partitions"] == []
    assert "shard 2" in three.stderr and len(three.stderr.strip().splitlines()) == 1
    # `vigil migrate --check` stops at it, one line naming the shard (not VIGIL_DATABASE_URL).
    check = vigil("migrate", "--check", env=shard_env(catalog, other, closed, partitions=6))
    assert_one_line(check, 3, "ledger shard 2 (postgresql://vigil@127.0.0.1:", "VIGIL_LEDGER_SHARDS", "refused")
    assert "hidden" not in check.stderr

    text = vigil("shards", env=shard_env(catalog, other, closed, partitions=6))
    assert text.returncode == 3
    assert text.stdout.splitlines()[1].split() == [
        "shard",
        "dsn",
        "partitions",
        "reachable",
        "schema",
        "events_waiting",
        "outbox_pending",
        "error",
    ]


def test_shards_on_one_shard_lists_every_partition_with_the_rule_before_migrate(databases):
    dsn = databases(migrated=True)
    listed = vigil("shards", "--json", env={"VIGIL_DATABASE_URL": dsn, "VIGIL_PARTITIONS": "3"})
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    assert report["map"] == "rule"  # no row yet: `vigil migrate` seeds them
    assert [(s["shard"], s["partitions"], s["reachable"]) for s in report["shards"]] == [(0, [0, 1, 2], True)]
