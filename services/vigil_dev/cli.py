"""``vigil-dev up|down|status|demo``: the whole system on this machine, as real processes.

``up`` starts (or finds running) a Kafka broker and PostgreSQL under ``.run/``, applies the
migrations, creates the topics, starts the services (``SERVICES``) and waits for their health checks,
then writes the settings it used to ``.run/env``. Running it twice is harmless: whatever is
already running (by its pid file) is left alone. ``down`` stops exactly the pids ``up``
wrote, services first so that none of them outlives its broker or database.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import click
import httpx
from psycopg.conninfo import conninfo_to_dict

from vigil.ledger.sealing import new_key
from vigil.paths import repo_root
from vigil_dev import broker, devstack
from vigil_dev.demo import demo as demo_command
from vigil_dev.scripted_server import DEMO_SCRIPT_PATH, ScriptError, compile_script, load_script
from vigil_dev.tls import LocalTLS

SERVICES = {
    # name -> (port setting, default port)
    "ingest": ("VIGIL_INGEST_PORT", 8080),
    "worker": ("VIGIL_WORKER_PORT", 9102),
    "scheduler": ("VIGIL_SCHEDULER_PORT", 9103),
    "dispatcher": ("VIGIL_DISPATCHER_PORT", 9104),
    "console": ("VIGIL_CONSOLE_PORT", 9105),
}
SCRIPTED_CLAUDE_PORT = 8765
OFFLINE_KEY = "offline-demo"  # what the scripted server is given as a key: it checks only that one is sent


def run_dir() -> Path:
    return Path(os.environ.get("VIGIL_DEV_RUN_DIR", repo_root() / ".run")).resolve()


def _secure_tls(root: Path) -> LocalTLS | None:
    """VIGIL_DEV_SECURE=1: the stack's certificates (made at the first start), else None."""
    value = os.environ.get("VIGIL_DEV_SECURE", "0").strip()
    if value not in ("0", "1"):
        raise click.ClickException(f"VIGIL_DEV_SECURE must be 1 (SASL_SSL and TLS) or 0 (unset), not {value!r}")
    return LocalTLS(root / "tls").ensure() if value == "1" else None


def _same_server(url: str, other: str) -> bool:
    """Whether two libpq URLs name one role on one database of one server (passwords aside)."""
    parts = ("host", "port", "dbname", "user")
    first, second = conninfo_to_dict(url), conninfo_to_dict(other)
    return all(first.get(part) == second.get(part) for part in parts)


def _stack_env(root: Path) -> dict[str, str]:
    """The VIGIL_ (and OTEL_) settings of the local stack: the caller's own values win."""
    kafka_port = int(os.environ.get("VIGIL_DEV_KAFKA_PORT", "9092"))
    pg_port = int(os.environ.get("VIGIL_DEV_PG_PORT", "5432"))
    env = {
        "VIGIL_KAFKA_BOOTSTRAP": f"127.0.0.1:{kafka_port}",
        "VIGIL_DATABASE_URL": f"postgresql://vigil@127.0.0.1:{pg_port}/vigil",
        "VIGIL_EVENTS_TOPIC": "vigil.events",
        "VIGIL_DLQ_TOPIC": "vigil.events.dlq",
        "VIGIL_DELIVERIES_TOPIC": "vigil.deliveries",
        "VIGIL_PARTITIONS": "12",
        "VIGIL_TOPIC_REPLICATION": "1",  # one broker
    }
    for _name, (variable, port) in SERVICES.items():
        env[variable] = str(port)
    # Generated once per stack and kept, so tokens already sent out stay valid across restarts.
    secret_file = root / "approval_secret"
    if not secret_file.exists():
        secret_file.write_text(secrets.token_urlsafe(32))
        secret_file.chmod(0o600)
    env["VIGIL_APPROVAL_SECRET"] = secret_file.read_text().strip()
    # The key that seals hook and channel secrets in the ledger: one per stack, kept like the above.
    key_file = root / "secret_key"
    if not key_file.exists():
        key_file.write_text(new_key())
        key_file.chmod(0o600)
    env["VIGIL_SECRET_KEY"] = key_file.read_text().strip()
    # The local stack runs the Claude agent (offline: the scripted server) with a deadline short
    # enough that the demo can show an unanswered approval expiring.
    env["VIGIL_AGENT"] = "claude"
    env["VIGIL_APPROVAL_DEADLINE_S"] = "20"
    # The demo's receivers run on this machine; outbound HTTP refuses loopback otherwise.
    env["VIGIL_OUTBOUND_ALLOWED_NETS"] = "127.0.0.0/8,::1/128"
    # The demo's MCP server (mcp_demo_server.py, read-only `shop__order_status`): each worker
    # starts it over stdio. Run as a file: it needs the `mcp` package only.
    server = Path(__file__).with_name("mcp_demo_server.py")
    env["VIGIL_MCP_SERVERS"] = json.dumps({"shop": {"command": sys.executable, "args": [str(server)]}})
    for key, value in os.environ.items():
        # OTEL_*: a service restarted from `. .run/env` exports its traces where `up`'s did.
        if key.startswith(("VIGIL_", "OTEL_")) and not key.startswith("VIGIL_DEV_"):
            env[key] = value
    return env


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """vigil's local stack: real Kafka, real PostgreSQL and the services, under .run/."""


# Where the stack listens and keeps its data: kept in .run/env, so that `make up` from a shell
# that sourced it finds the same stack (and does not take its own PostgreSQL for an external one).
DEV_SETTINGS = (
    "VIGIL_DEV_RUN_DIR",
    "VIGIL_DEV_KAFKA_PORT",
    "VIGIL_DEV_KAFKA_CONTROLLER_PORT",
    "VIGIL_DEV_PG_PORT",
    "VIGIL_DEV_CLAUDE_PORT",
    "VIGIL_DEV_KAFKA_LIBS",
    "VIGIL_DEV_SHARDS",
    "VIGIL_DEV_PG_SHARD_PORTS",
    "VIGIL_DEV_SECURE",
    "VIGIL_DEV_SCRIPT",
)


def _shard_servers(root: Path, pg_port: int, tls: LocalTLS | None = None) -> list[devstack.PostgresServer]:
    """The ledger's other shards (VIGIL_DEV_SHARDS, default 1: none): PostgreSQL servers like the
    first, each in ``.run/pg<N>/`` on its own port, VIGIL_DEV_PG_SHARD_PORTS (comma separated)
    or the first's port plus N."""
    try:
        count = int(os.environ.get("VIGIL_DEV_SHARDS", "1"))
    except ValueError:
        count = 0
    if count < 1:
        raise click.ClickException("VIGIL_DEV_SHARDS must be a whole number of at least 1")
    given = os.environ.get("VIGIL_DEV_PG_SHARD_PORTS", "")
    try:
        ports = [int(p) for p in given.split(",")] if given else [pg_port + n for n in range(1, count)]
    except ValueError:
        raise click.ClickException("VIGIL_DEV_PG_SHARD_PORTS must be ports, comma separated") from None
    if len(ports) < count - 1:
        raise click.ClickException(
            f"VIGIL_DEV_PG_SHARD_PORTS names {len(ports)} port(s) for {count - 1} other shard(s)"
        )
    return [devstack.PostgresServer(root / f"pg{n}" / "data", ports[n - 1], tls=tls) for n in range(1, count)]


def _pg_pidfiles(root: Path) -> dict[str, Path]:
    """``postgresql`` (shard 0, the catalog) and ``postgresql-N`` for each other shard's server."""
    found = {"postgresql": root / "pg" / "postgres.pid"}
    for folder in sorted(root.glob("pg[0-9]*"), key=lambda f: int(f.name[2:])):
        found[f"postgresql-{folder.name[2:]}"] = folder / "postgres.pid"
    return found


@main.command()
@click.option("--services/--no-services", default=True, help=f"Start the vigil services too: {', '.join(SERVICES)}.")
@click.option(
    "--demo", is_flag=True, help="Run `vigil-dev demo` afterwards, only if this started the stack's services."
)
@click.option(
    "--script",
    type=click.Path(path_type=Path),
    envvar="VIGIL_DEV_SCRIPT",
    help="The offline model's script (JSON, see docs/agent.md); default: the demo's. Loaded into a running "
    "scripted server too.",
)
def up(services: bool, demo: bool, script: Path | None) -> None:
    """Start everything (idempotent) and write .run/env."""
    offline = os.environ.get("ANTHROPIC_API_KEY", OFFLINE_KEY) == OFFLINE_KEY
    # Checked before anything starts: a bad script found after Kafka and the services are up
    # would leave a stack whose every run fails on the model's 500.
    named = script is not None  # by --script or VIGIL_DEV_SCRIPT: a running server must answer from it
    script = _checked_script(script, offline)
    root = run_dir()
    root.mkdir(parents=True, exist_ok=True)
    env = _stack_env(root)
    kafka_port = int(env["VIGIL_KAFKA_BOOTSTRAP"].rsplit(":", 1)[1])
    tls = _secure_tls(root)
    try:
        # VIGIL_DEV_KAFKA_LIBS reuses jars fetched elsewhere (tests start stacks in temp folders).
        libs = (
            Path(os.environ["VIGIL_DEV_KAFKA_LIBS"])
            if os.environ.get("VIGIL_DEV_KAFKA_LIBS")
            else broker.kafka_libs(root / "kafka")
        )
        kafka = broker.KafkaServer(
            root / "kafka" / "data",
            kafka_port,
            int(os.environ.get("VIGIL_DEV_KAFKA_CONTROLLER_PORT", kafka_port + 1)),
            libs,
            tls=tls,
        )
        kafka.start()
        # The CLI's and the tooling's Kafka user (the services get their own below).
        env.update(kafka.client_env())
        security = f", SASL_SSL {broker.SCRAM_MECHANISM}, CA {tls.ca}" if tls else ""
        click.echo(f"kafka       {kafka.bootstrap}  (Apache Kafka, KRaft{security}, logs {kafka.logfile})")
        local_pg_url = f"postgresql://vigil@127.0.0.1:{os.environ.get('VIGIL_DEV_PG_PORT', '5432')}/vigil"
        # A shell that sourced .run/env carries this stack's URL with its password: still local.
        if _same_server(env["VIGIL_DATABASE_URL"], local_pg_url):
            pg = devstack.PostgresServer(
                root / "pg" / "data", int(os.environ.get("VIGIL_DEV_PG_PORT", "5432")), tls=tls
            )
            pg.start()
            env["VIGIL_DATABASE_URL"] = pg.url()
            # For `. .run/env && make test`: the tests clone databases, which the services' role may not.
            admin_url = {"VIGIL_DEV_ADMIN_DATABASE_URL": pg.admin_url()}
            auth = "TLS only, password authentication" if tls else "password authentication"
            click.echo(f"postgresql  {pg.shown_url()}  ({auth}, logs {pg.logfile})")
            others = _shard_servers(root, pg.port, tls)
            env.pop("VIGIL_LEDGER_SHARDS", None)  # the stack's shards are the servers started here
            for n, server in enumerate(others, start=1):
                server.start()
                click.echo(f"shard {n:<5} {server.shown_url()}  ({auth}, logs {server.logfile})")
            if others:
                env["VIGIL_LEDGER_SHARDS"] = ",".join([pg.url(), *(server.url() for server in others)])
        else:
            if _shard_servers(root, 0):
                raise click.ClickException(
                    "VIGIL_DEV_SHARDS needs the stack's own PostgreSQL, not VIGIL_DATABASE_URL's"
                )
            admin_url = {}
            click.echo("postgresql  VIGIL_DATABASE_URL (external, not started here)")
    except devstack.StackError as exc:
        raise click.ClickException(str(exc)) from None

    child_env = {**os.environ, **env}
    if "VIGIL_LEDGER_SHARDS" not in env:  # a shell's from an earlier stack with more shards
        child_env.pop("VIGIL_LEDGER_SHARDS", None)
    vigil = [sys.executable, "-m", "vigil"]
    for step in (["migrate"], ["topics"]):
        result = subprocess.run([*vigil, *step], env=child_env, capture_output=True, text=True)
        if result.returncode != 0:
            raise click.ClickException(f"vigil {' '.join(step)} failed:\n{result.stderr}{result.stdout}")
        click.echo(f"            {result.stdout.strip()}")

    env.update(_api_token(root, vigil, child_env))

    # A shell that sourced .run/env carries the offline placeholder key: still offline.
    if offline:
        env.update(_start_scripted_claude(root, child_env, script, replace=named))
        child_env.update(env)

    started = []
    if services:
        for name in SERVICES:
            pidfile = root / "pids" / f"{name}.pid"
            if devstack.read_pid(pidfile) is None:
                started.append(name)
                # Each service its own Kafka user on the secure stack (the broker's logs name it).
                service_env = {**child_env, **kafka.client_env(name)}
                devstack.spawn([*vigil, name], root / "logs" / f"{name}.log", pidfile, env=service_env, cwd=repo_root())
        for name, (variable, _) in SERVICES.items():
            port = env[variable]
            logfile = root / "logs" / f"{name}.log"
            try:
                url = f"http://127.0.0.1:{port}/healthz"
                devstack.wait_until(lambda url=url: devstack.http_ok(url), 60, name, logfile)
            except devstack.StackError as exc:
                raise click.ClickException(str(exc)) from None
            where = {
                "ingest": "HTTP API, /healthz /readyz /metrics",
                "console": "operator console: log in with $VIGIL_API_TOKEN; /healthz /readyz /metrics",
            }.get(name, "/healthz /readyz /metrics")
            click.echo(f"{name:<11} http://127.0.0.1:{port}  ({where}, logs {logfile})")

    kept = {
        "VIGIL_DEV_RUN_DIR": str(root),
        "VIGIL_DEV_KAFKA_PORT": str(kafka_port),
        "VIGIL_DEV_KAFKA_CONTROLLER_PORT": str(kafka.controller_port),
        "VIGIL_DEV_PG_PORT": os.environ.get("VIGIL_DEV_PG_PORT", "5432"),
        **{k: os.environ[k] for k in DEV_SETTINGS if os.environ.get(k)},
        **admin_url,
    }
    if offline:  # which script the model answers from; a restart from a shell that sourced .run/env keeps it
        kept["VIGIL_DEV_SCRIPT"] = str(script)
    env_file = root / "env"
    # The virtualenv's bin first on PATH, so `vigil ...` works in the shell that sourced it.
    path_line = f'export PATH={shlex.quote(str(Path(sys.executable).parent))}:"$PATH"\n'
    env_file.write_text(
        path_line + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted({**env, **kept}.items()))
    )
    env_file.chmod(0o600)
    click.echo(f"settings    {env_file}  (`. {env_file}` points a shell at this stack)")
    if demo and script != DEMO_SCRIPT_PATH:
        click.echo(f"demo        not run: it needs the demo's script, and {script} is loaded")
    elif demo and "worker" in started:
        demo_run = subprocess.run([sys.executable, "-m", "vigil_dev", "demo"], env={**child_env, **env})
        if demo_run.returncode != 0:
            raise SystemExit(demo_run.returncode)
    elif demo:
        click.echo("demo        not run again: the stack was already up (`make demo` runs it)")


def _api_token(root: Path, vigil: list[str], env: dict) -> dict[str, str]:
    """A bearer token for the local stack's HTTP API (`curl -H "Authorization: Bearer $VIGIL_API_TOKEN"`).

    Created once and kept in .run/api_token (mode 600): the ledger stores only its hash.
    """
    token_file = root / "api_token"
    if not token_file.exists():
        result = subprocess.run(
            [*vigil, "tokens", "create", "local-dev", "--json"], env=env, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise click.ClickException(f"creating the local API token failed:\n{result.stderr}")
        token_file.write_text(json.loads(result.stdout)["token"])
        token_file.chmod(0o600)
    return {"VIGIL_API_TOKEN": token_file.read_text().strip()}


def _checked_script(given: Path | None, offline: bool) -> Path:
    """The script the offline model will answer from, read and compiled as the server will.

    Raises a ClickException naming the file and the problem (unreadable, not JSON, a bad
    rule), or when a script is given but ANTHROPIC_API_KEY names the real API."""
    if given is None:
        return DEMO_SCRIPT_PATH
    if not offline:
        raise click.ClickException(
            f"--script {given}: the scripted model is started only without ANTHROPIC_API_KEY (it is set)"
        )
    path = given.resolve()
    try:
        compile_script(load_script(path))
    except OSError as exc:
        raise click.ClickException(f"script {path}: {exc.strerror or exc}") from None
    except (ValueError, ScriptError) as exc:  # json.JSONDecodeError is a ValueError
        raise click.ClickException(f"script {path}: {exc}") from None
    return path


def _start_scripted_claude(root: Path, env: dict, script: Path, replace: bool) -> dict[str, str]:
    """Without ANTHROPIC_API_KEY, the agent talks to the local scripted Messages API server.

    A server already running (by its pid file) is left alone unless ``replace``: then, when its
    script differs, it is given ``script`` through ``PUT /_script``, so `up --script` on a
    running stack changes what the model answers without a restart (and an `up` from a shell
    that sourced .run/env, which names the same script, resets no rule's ``times``)."""
    port = int(os.environ.get("VIGIL_DEV_CLAUDE_PORT", SCRIPTED_CLAUDE_PORT))
    pidfile = root / "pids" / "scripted-claude.pid"
    logfile = root / "logs" / "scripted-claude.log"
    started = devstack.read_pid(pidfile) is None
    if started:
        devstack.spawn(
            [
                sys.executable,
                "-m",
                "vigil_dev.scripted_server",
                "--script",
                str(script),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            logfile,
            pidfile,
            env=env,
        )
    devstack.wait_until(lambda: devstack.port_open(port), 30, "scripted Claude server", logfile)
    if replace and not started:
        _load_script(port, script)
    click.echo(f"claude      http://127.0.0.1:{port}  (offline: scripted Messages API, script {script})")
    return {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}", "ANTHROPIC_API_KEY": OFFLINE_KEY}


def _load_script(port: int, script: Path) -> None:
    """Replace the running scripted server's script if it differs (204, or 400 with the reason)."""
    url = f"http://127.0.0.1:{port}/_script"
    try:
        running = httpx.get(url, timeout=10).raise_for_status().json()
        if running == json.loads(script.read_bytes()):
            return
        httpx.put(url, content=script.read_bytes(), timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise click.ClickException(f"loading {script} into the running scripted server: {exc}") from None


@main.command()
def down() -> None:
    """Stop everything `vigil-dev up` started (by pid, nothing else)."""
    root = run_dir()
    stopped = []
    for name in [*SERVICES, "scripted-claude"]:
        if devstack.stop(root / "pids" / f"{name}.pid"):
            stopped.append(name)
    if devstack.stop(root / "kafka" / "data" / "kafka.pid", timeout=30):
        stopped.append("kafka")
    for name, pidfile in _pg_pidfiles(root).items():
        if devstack.stop(pidfile, timeout=30):
            stopped.append(name)
    click.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per part: name, state, pid.")
def status(as_json: bool) -> None:
    """Which parts of the local stack are running."""
    root = run_dir()
    rows = {name: root / "pids" / f"{name}.pid" for name in [*SERVICES, "scripted-claude"]}
    rows["kafka"] = root / "kafka" / "data" / "kafka.pid"
    rows.update(_pg_pidfiles(root))
    for name, pidfile in rows.items():
        pid = devstack.read_pid(pidfile)  # a killed process not yet reaped (a zombie) counts as stopped
        state = "running" if pid else ("dead" if pidfile.exists() else "stopped")
        if as_json:
            click.echo(json.dumps({"name": name, "state": state, "pid": pid}))
        elif pid:
            click.echo(f"{name:<16} running pid {pid}")
        else:
            click.echo(f"{name:<16} {'dead (pid file left behind)' if state == 'dead' else 'stopped'}")


main.add_command(demo_command)
