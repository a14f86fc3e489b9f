"""Secrets at rest and the dev stack's database roles (issue 46, item 6).

- Hook and channel secrets are sealed with VIGIL_SECRET_KEY: a row read straight from
  PostgreSQL holds no secret, and a webhook signed with the secret still verifies on a real
  ingest process.
- Rotation (`vigil secrets rotate` with VIGIL_SECRET_OLD_KEYS) seals every row again, clear
  ones from before migration 0029 included; with the old key removed the hook still works,
  and a service that lacks the sealing key refuses to start, naming the setting.
- The dev stack's PostgreSQL asks for a password, and the services' role is no superuser.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest
from cryptography.fernet import Fernet

from support import query
from test_ingest_process import github_delivery
from vigil.ledger.sealing import BOUND, Keys, Place, SecretKeyError, key_id
from vigil_dev import devstack


def vigil(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    """`vigil ARGS` as a process with exactly these VIGIL_ settings (no key unless given)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_SECRET_")}
    return subprocess.run(
        [sys.executable, "-m", "vigil", *args],
        env={**clean, **env},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def keyed(env: dict[str, str], key: str | None, old: str | None = None) -> dict[str, str]:
    out = {k: v for k, v in env.items() if not k.startswith("VIGIL_SECRET_")}
    if key:
        out["VIGIL_SECRET_KEY"] = key
    if old:
        out["VIGIL_SECRET_OLD_KEYS"] = old
    return out


def add_github_hook(env: dict[str, str]) -> dict:
    result = vigil("hooks", "add", "--provider", "github", "--user", "u-sealed", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def post_signed(env: dict[str, str], hook: dict, secret: str) -> httpx.Response:
    body, headers = github_delivery(secret, f"d-{uuid.uuid4().hex[:8]}")
    port = env["VIGIL_INGEST_PORT"]
    return httpx.post(f"http://127.0.0.1:{port}{hook['path']}", content=body, headers=headers, timeout=10)


def ingest_answers(spawn, env: dict[str, str], hook: dict, secret: str, name: str) -> int:
    """Start ingest with ``env``'s keys (and not the session's), post one delivery signed with
    ``secret``; its status."""
    process = spawn(["ingest"], {**env, "VIGIL_SECRET_KEY": env.get("VIGIL_SECRET_KEY", "")}, name=name)
    process.wait_healthy(int(env["VIGIL_INGEST_PORT"]))
    try:
        return post_signed(env, hook, secret).status_code
    finally:
        process.stop()


def test_a_hook_secret_is_sealed_in_the_row_and_still_verifies_on_a_real_ingest(spawn, vigil_env, ledger):
    key = Fernet.generate_key().decode()
    env = keyed(vigil_env, key)
    hook = add_github_hook(env)
    rows = query(ledger, "SELECT secret, sealed_with FROM hook_secrets")
    assert len(rows) == 1
    assert hook["secret"] not in rows[0]["secret"]
    assert rows[0]["sealed_with"] == key_id(key)
    assert rows[0]["secret"].startswith(BOUND)
    assert Keys(key).open(rows[0]["secret"], key_id(key), Place("hook_secrets", hook["id"])) == hook["secret"]

    assert ingest_answers(spawn, env, hook, hook["secret"], "ingest") == 202
    assert ingest_answers(spawn, env, hook, "not-the-secret-at-all", "ingest-bad") == 401


def test_a_channel_secret_is_sealed_in_the_row(vigil_env, ledger):
    key = Fernet.generate_key().decode()
    env = keyed(vigil_env, key)
    result = vigil(
        "channels", "set", "u-ch", "--type", "webhook", "--url", "http://127.0.0.1:9/hook", "--json", env=env
    )
    assert result.returncode == 0, result.stderr
    secret = json.loads(result.stdout)["secret"]
    row = query(ledger, "SELECT secret, sealed_with FROM channels WHERE user_id = 'u-ch'")[0]
    assert secret not in row["secret"] and secret.removeprefix("whsec_") not in row["secret"]
    assert row["sealed_with"] == key_id(key)
    # An edit keeps the secret the receiver holds: opened, then sealed again.
    again = vigil("channels", "set", "u-ch", "--type", "webhook", "--url", "http://127.0.0.1:9/other", env=env)
    assert again.returncode == 0, again.stderr
    kept = query(ledger, "SELECT secret FROM channels WHERE user_id = 'u-ch'")[0]["secret"]
    assert Keys(key).open(kept, key_id(key), Place("channels", "u-ch")) == secret


@pytest.mark.slow
def test_rotation_seals_clear_rows_then_moves_keys_and_the_old_key_can_go(spawn, vigil_env, ledger):
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    # A deployment from before 0029: the secret in clear, no key.
    hook = add_github_hook(keyed(vigil_env, None))
    assert query(ledger, "SELECT secret, sealed_with FROM hook_secrets")[0] == {
        "secret": hook["secret"],
        "sealed_with": None,
    }
    # Upgrading: the key is set and `vigil secrets rotate` seals what is in clear.
    sealed = vigil("secrets", "rotate", "--json", env=keyed(vigil_env, old))
    assert sealed.returncode == 0, sealed.stderr
    assert json.loads(sealed.stdout)["resealed"] == 1
    assert query(ledger, "SELECT sealed_with FROM hook_secrets")[0]["sealed_with"] == key_id(old)

    # A sealed row and no key: the service refuses to start, naming the setting.
    refused = vigil("ingest", env=keyed(vigil_env, None))
    assert refused.returncode == 2 and "VIGIL_SECRET_KEY is not set" in refused.stderr, refused.stderr

    # Rotating: the new key seals, the old one only opens.
    rotated = vigil("secrets", "rotate", "--json", env=keyed(vigil_env, new, old))
    assert rotated.returncode == 0, rotated.stderr
    assert json.loads(rotated.stdout)["resealed"] == 1
    row = query(ledger, "SELECT secret, sealed_with FROM hook_secrets")[0]
    assert row["sealed_with"] == key_id(new) and hook["secret"] not in row["secret"]
    # Idempotent: an interrupted rotation is finished by running it again; nothing is left.
    twice = vigil("secrets", "rotate", "--json", env=keyed(vigil_env, new, old))
    assert json.loads(twice.stdout)["resealed"] == 0

    # The old key removed: the hook still verifies on a real ingest.
    assert ingest_answers(spawn, keyed(vigil_env, new), hook, hook["secret"], "ingest-new") == 202
    # Only the old key: refused at start, naming where the missing key goes.
    stale = vigil("ingest", env=keyed(vigil_env, old))
    assert stale.returncode == 2 and "VIGIL_SECRET_OLD_KEYS" in stale.stderr, stale.stderr
    status = vigil("secrets", "status", "--json", env=keyed(vigil_env, new))
    assert json.loads(status.stdout)["secrets"] == [
        {"table": "hook_secrets", "sealed_with": key_id(new), "secrets": 1, "held": True}
    ]


def test_migrate_with_a_key_seals_the_secrets_left_in_clear(vigil_env, ledger):
    key = Fernet.generate_key().decode()
    hook = add_github_hook(keyed(vigil_env, None))
    migrated = vigil("migrate", "--json", env=keyed(vigil_env, key))
    assert migrated.returncode == 0, migrated.stderr
    assert json.loads(migrated.stdout)["secrets_sealed"] == 1
    row = query(ledger, "SELECT secret, sealed_with FROM hook_secrets")[0]
    assert row["sealed_with"] == key_id(key) and hook["secret"] not in row["secret"]


def test_a_sealed_secret_copied_into_another_row_does_not_open_there(vigil_env, ledger):
    """Issue 58: Fernet has no associated data, so whoever could write the ledger could copy
    one user's sealed channel secret into another's row (or one hook's into another's), and
    it opened. The seal is now bound to its table, owner and column."""
    key = Fernet.generate_key().decode()
    env = keyed(vigil_env, key)
    for user in ("u-a", "u-b"):
        made = vigil("channels", "set", user, "--type", "webhook", "--url", "http://127.0.0.1:9/h", env=env)
        assert made.returncode == 0, made.stderr
    query(
        ledger, "UPDATE channels SET secret = (SELECT secret FROM channels WHERE user_id = 'u-a') WHERE user_id = 'u-b'"
    )
    rows = {r["user_id"]: r for r in query(ledger, "SELECT user_id, secret, sealed_with FROM channels")}
    assert Keys(key).open(rows["u-a"]["secret"], key_id(key), Place("channels", "u-a"))
    with pytest.raises(SecretKeyError, match="does not open in channels row 'u-b'"):
        Keys(key).open(rows["u-b"]["secret"], key_id(key), Place("channels", "u-b"))
    with pytest.raises(SecretKeyError):  # nor as a hook's secret, nor in another column
        Keys(key).open(rows["u-a"]["secret"], key_id(key), Place("hook_secrets", "u-a"))
    with pytest.raises(SecretKeyError):
        Keys(key).open(rows["u-a"]["secret"], key_id(key), Place("channels", "u-a", "url"))


def test_a_hook_secret_copied_from_another_hook_is_refused_by_ingest_not_a_500(spawn, vigil_env, ledger):
    """Issue 58 at the service: whoever can write the ledger copies hook A's sealed secret
    into hook B's row; a delivery to B signed with A's secret must not verify, nor be a 500."""
    env = keyed(vigil_env, Fernet.generate_key().decode())
    a, b = add_github_hook(env), add_github_hook(env)
    query(
        ledger,
        "UPDATE hook_secrets SET secret = (SELECT secret FROM hook_secrets WHERE hook_id = %s) WHERE hook_id = %s",
        (a["id"], b["id"]),
    )
    process = spawn(["ingest"], env, name="ingest-swapped")
    process.wait_healthy(int(env["VIGIL_INGEST_PORT"]))
    try:
        answers = [post_signed(env, b, secret) for secret in (a["secret"], b["secret"])]
    finally:
        process.stop()
    for response in answers:
        assert (response.status_code, response.json()["error"]) == (401, "invalid_signature"), response.text
    assert "Traceback" not in process.log(), process.log()
    assert query(ledger, "SELECT count(*) AS n FROM events")[0]["n"] == 0


def test_a_channel_secret_copied_from_another_user_dead_letters_only_that_users_delivery(ledger, monkeypatch):
    """Issue 58 at the dispatcher: a channel secret copied into another user's row does not
    open there. Before, the claim's open raised out of the pass, for every user it locked (a
    dispatcher that delivers nothing, again at every pass); now that user's delivery is dead
    with a reason, the log names the row, and the others' go out."""
    from dispatcher_support import T0, Receiver, add_message, add_webhook_users, in_process_dispatcher, one_pass
    from vigil.clock import ManualClock
    from vigil.ledger import sealing

    key = Fernet.generate_key().decode()
    monkeypatch.setenv("VIGIL_SECRET_KEY", key)
    sealing.keys.cache_clear()
    receiver = Receiver().start()
    try:
        clear = add_webhook_users(ledger, ["u-a", "u-b"], receiver.url)
        for user, secret in clear.items():
            sealed, kid = Keys(key).seal(secret, Place("channels", user))
            query(ledger, "UPDATE channels SET secret = %s, sealed_with = %s WHERE user_id = %s", (sealed, kid, user))
        query(
            ledger,
            "UPDATE channels SET secret = (SELECT secret FROM channels WHERE user_id = 'u-a') WHERE user_id = 'u-b'",
        )
        for user in ("u-a", "u-b"):
            add_message(ledger, user, f"hello {user}", created_at=T0)
        d = in_process_dispatcher(ledger, ManualClock(T0.timestamp()))
        try:
            one_pass(d)
        finally:
            d.close()
        got = receiver.got()
    finally:
        receiver.server.shutdown()
        sealing.keys.cache_clear()
    rows = {r["user_id"]: r for r in query(ledger, "SELECT user_id, status, error FROM outbox")}
    assert rows["u-a"]["status"] == "delivered" and len(got) == 1, (rows, got)
    assert (rows["u-b"]["status"], rows["u-b"]["error"]) == ("dead", "webhook channel without url or secret"), rows


@pytest.mark.parametrize(
    ("command", "count"), [(("secrets", "rotate", "--json"), "resealed"), (("migrate", "--json"), "secrets_sealed")]
)
def test_a_row_sealed_before_the_binding_opens_and_rotate_or_migrate_binds_it(vigil_env, ledger, command, count):
    key = Fernet.generate_key().decode()
    env = keyed(vigil_env, key)
    hook = add_github_hook(env)
    legacy = Fernet(key.encode()).encrypt(hook["secret"].encode()).decode()  # as sealed before issue 58
    query(ledger, "UPDATE hook_secrets SET secret = %s", (legacy,))
    assert Keys(key).open(legacy, key_id(key), Place("hook_secrets", hook["id"])) == hook["secret"]
    rotated = vigil(*command, env=env)
    assert rotated.returncode == 0 and json.loads(rotated.stdout)[count] == 1, rotated.stderr
    row = query(ledger, "SELECT secret, sealed_with FROM hook_secrets")[0]
    assert row["secret"].startswith(BOUND) and row["sealed_with"] == key_id(key)
    assert Keys(key).open(row["secret"], key_id(key), Place("hook_secrets", hook["id"])) == hook["secret"]
    assert json.loads(vigil(*command, env=env).stdout)[count] == 0


def test_production_without_a_key_is_a_startup_error_naming_the_setting(vigil_env):
    for service in ("ingest", "dispatcher"):
        refused = vigil(service, env={**keyed(vigil_env, None), "VIGIL_ENV": "production"})
        assert refused.returncode == 2 and "VIGIL_SECRET_KEY is not set" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    bad = vigil("ingest", env={**keyed(vigil_env, None), "VIGIL_ENV": "prod"})
    assert bad.returncode == 2 and "VIGIL_ENV" in bad.stderr, bad.stderr


def test_production_without_a_key_refuses_the_commands_that_store_a_secret_and_stores_nothing(vigil_env, ledger):
    """Issue 58: the services refused to start, but `hooks add`, `hooks rotate` and `channels
    set` still stored new secrets in clear with VIGIL_ENV=production; they go through the same
    rule (vigil.ledger.sealing.Keys.seal)."""
    hook = add_github_hook(keyed(vigil_env, None))  # made in development, to rotate below
    production = {**keyed(vigil_env, None), "VIGIL_ENV": "production"}
    for args in (
        ("hooks", "add", "--provider", "github", "--user", "u-prod"),
        ("hooks", "rotate", hook["id"]),
        ("channels", "set", "u-prod", "--type", "webhook", "--url", "http://127.0.0.1:9/h"),
    ):
        refused = vigil(*args, env=production)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert "VIGIL_SECRET_KEY is not set" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert [r["id"] for r in query(ledger, "SELECT id FROM hooks")] == [hook["id"]]
    assert query(ledger, "SELECT count(*) AS n FROM hook_secrets")[0]["n"] == 1
    assert query(ledger, "SELECT count(*) AS n FROM channels")[0]["n"] == 0
    assert query(ledger, "SELECT count(*) AS n FROM audit")[0]["n"] == 1  # the development hook.add only
    kafka = vigil("channels", "set", "u-prod", "--type", "kafka", env=production)  # no secret to store
    assert kafka.returncode == 0, kafka.stderr


def test_a_bad_key_is_refused_naming_the_setting(vigil_env):
    result = vigil("secrets", "rotate", env=keyed(vigil_env, "not-a-fernet-key"))
    assert result.returncode == 2 and "VIGIL_SECRET_KEY" in result.stderr, result.stderr
    assert "not-a-fernet-key" not in result.stderr


@pytest.mark.slow
@pytest.mark.stack  # starts a PostgreSQL server of its own
def test_the_dev_database_asks_for_a_password_and_its_services_role_is_no_superuser():
    root = Path(tempfile.mkdtemp(prefix="vigil-secrets-pg-"))
    os.chmod(root, 0o755)
    pg = devstack.PostgresServer(root / "pg" / "data", devstack.free_port())
    try:
        pg.start()
        with psycopg.connect(pg.url()) as conn:
            role = conn.execute(
                "SELECT rolsuper, rolcreaterole, rolcreatedb FROM pg_roles WHERE rolname = current_user"
            ).fetchone()
            owner = conn.execute(
                "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()"
            ).fetchone()
        assert role == (False, False, False)
        assert owner == ("vigil",)
        # The services' role runs the migrations on its own database.
        migrated = vigil("migrate", env={"VIGIL_DATABASE_URL": pg.url()})
        assert migrated.returncode == 0, migrated.stderr
        # Without the password, or with a wrong one, nobody gets in: not over TCP, not over the socket.
        for url in (
            f"postgresql://vigil@127.0.0.1:{pg.port}/vigil",
            f"postgresql://vigil:wrong@127.0.0.1:{pg.port}/vigil",
            f"postgresql://{devstack.ADMIN_USER}@127.0.0.1:{pg.port}/postgres",
            f"host={pg.data_dir} port={pg.port} user=vigil dbname=vigil",
        ):
            with pytest.raises(psycopg.OperationalError, match="password"):
                psycopg.connect(url, connect_timeout=5).close()
        assert oct((root / "pg" / "vigil.password").stat().st_mode)[-3:] == "600"
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
