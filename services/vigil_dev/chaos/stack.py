"""The chaos run's stack: started, faulted and restarted through ``vigil-dev up``, as an
operator would bring it back."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psycopg

from vigil.ledger.db import connect
from vigil.paths import repo_root
from vigil_dev import broker, devstack
from vigil_dev.queries import Q
from vigil_dev.tls import LocalTLS

SERVICES = ("ingest", "worker", "scheduler", "dispatcher")
# Workers beyond `vigil-dev up`'s one, started by the chaos stack itself in the same consumer
# group: a kill or a freeze of one moves its partitions to the other, and its restart moves
# them back through the hand-over (fencing rule 4), so rebalances happen under load.
EXTRA_WORKERS = ("worker-b",)
# Dispatchers beyond `vigil-dev up`'s one: two replicas share the outbox through the users'
# row locks, and a kill of one leaves its sends to the other after their lease.
EXTRA_DISPATCHERS = ("dispatcher-b",)
# A restart that fails (PostgreSQL's old backends still exiting, a port not yet free) is tried
# again after this long, up to this many times.
RESTART_PAUSE_S = 1.0
RESTART_TRIES = 20


@dataclass
class Ports:
    kafka: int
    controller: int
    pg: int
    ingest: int
    worker: int
    scheduler: int
    dispatcher: int
    claude: int
    worker_b: int
    dispatcher_b: int

    @classmethod
    def pick(cls, base: int | None) -> Ports:
        if base is None:
            return cls(*(devstack.free_port() for _ in range(10)))
        return cls(*range(base, base + 10))


class ChaosStack:
    def __init__(
        self,
        root: Path,
        ports: Ports,
        session_timeout_ms: int,
        extra_env: dict[str, str],
        workers: int = 2,
        dispatchers: int = 2,
        script: dict | None = None,
        shards: int = 1,
    ):
        self.root = root
        # Held by whoever kills or brings back a process: the nemesis and the poison's
        # supervisor (vigil_dev.chaos.actions) never restart the stack at the same time.
        self.lock = threading.RLock()
        # The ledger's shards: shard 0 on ports.pg, each other one on a server of its own
        # (`vigil-dev up`'s VIGIL_DEV_SHARDS), whose kill is the fault "kill-shard".
        self.shards = shards
        self.shard_ports = [ports.pg, *(devstack.free_port() for _ in range(shards - 1))]
        self.script = script  # the scripted Messages API's script (vigil_dev.chaos.actions), put after each up
        self.ports = ports
        self.session_timeout_ms = session_timeout_ms
        self.workers = ["worker", *EXTRA_WORKERS[: max(0, workers - 1)]]
        self.dispatchers = ["dispatcher", *EXTRA_DISPATCHERS[: max(0, dispatchers - 1)]]
        # The broker's jars: wherever the developer's stack keeps them (fetched once).
        libs_root = Path(os.environ.get("VIGIL_DEV_RUN_DIR", repo_root() / ".run"))
        self.libs = broker.kafka_libs(libs_root / "kafka")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("VIGIL_", "ANTHROPIC_"))}
        # VIGIL_DEV_SECURE=1: the whole run on Kafka SASL_SSL and PostgreSQL TLS (docs/faults.md).
        secure = os.environ.get("VIGIL_DEV_SECURE", "0")
        self.tls = LocalTLS(root / "tls") if secure == "1" else None
        self.env = {
            **base,
            "VIGIL_DEV_SECURE": secure,
            "VIGIL_DEV_RUN_DIR": str(root),
            "VIGIL_DEV_KAFKA_LIBS": str(self.libs),
            "VIGIL_DEV_KAFKA_PORT": str(ports.kafka),
            "VIGIL_DEV_KAFKA_CONTROLLER_PORT": str(ports.controller),
            "VIGIL_DEV_PG_PORT": str(ports.pg),
            "VIGIL_DEV_SHARDS": str(shards),
            "VIGIL_DEV_PG_SHARD_PORTS": ",".join(map(str, self.shard_ports[1:])),
            "VIGIL_DEV_CLAUDE_PORT": str(ports.claude),
            "VIGIL_INGEST_PORT": str(ports.ingest),
            "VIGIL_WORKER_PORT": str(ports.worker),
            "VIGIL_SCHEDULER_PORT": str(ports.scheduler),
            "VIGIL_DISPATCHER_PORT": str(ports.dispatcher),
            # The load: chat messages echoed back (no model; `--agent claude`, the default, puts
            # the acting Claude agent of vigil_dev.chaos.actions over it), every reply delivered at once.
            "VIGIL_AGENT": "echo",
            "VIGIL_OUTBOX_GAP": "0",
            "VIGIL_KAFKA_SESSION_TIMEOUT_MS": str(session_timeout_ms),
            **extra_env,
        }

    # -- whole stack ------------------------------------------------------------------

    def fresh(self) -> None:
        """A new stack: nothing of an earlier run (data, logs, pids) is kept."""
        self.down()
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)

    def up(self) -> float:
        """``vigil-dev up`` until it succeeds, then the extra workers and dispatchers; the
        seconds it took."""
        began = time.monotonic()
        last = ""
        for _ in range(RESTART_TRIES):
            result = subprocess.run(
                [sys.executable, "-m", "vigil_dev", "up"], env=self.env, capture_output=True, text=True
            )
            if result.returncode == 0:
                self._extras_up()
                self._script_up()
                return time.monotonic() - began
            last = (result.stderr or result.stdout)[-1500:]
            time.sleep(RESTART_PAUSE_S)
        raise RuntimeError(f"vigil-dev up kept failing:\n{last}")

    def _extras_up(self) -> None:
        """Start each extra worker and dispatcher that is not running, with the stack's own
        settings (the ``env`` file `vigil-dev up` wrote) and a port of its own; wait for its
        /healthz."""
        settings = self.settings()
        extras = [("worker", n) for n in self.workers[1:]] + [("dispatcher", n) for n in self.dispatchers[1:]]
        for service, name in extras:
            if self.pid(name) is not None:
                continue
            port = self.port_of(name)
            env = {
                **self.env,
                **settings,
                f"VIGIL_{service.upper()}_PORT": str(port),
                "VIGIL_INSTANCE_ID": f"chaos-{name}",
            }
            logfile = self.root / "logs" / f"{name}.log"
            devstack.spawn(
                [sys.executable, "-m", "vigil", service], logfile, self.pidfile(name), env=env, cwd=repo_root()
            )
            url = f"http://127.0.0.1:{port}/healthz"
            devstack.wait_until(lambda url=url: devstack.http_ok(url), 60, name, logfile)

    def settings(self) -> dict[str, str]:
        """The stack's own settings: the ``env`` file `vigil-dev up` wrote."""
        settings = {}
        for line in (self.root / "env").read_text().splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            if name.startswith(("VIGIL_", "ANTHROPIC_")):
                settings[name] = shlex.split(value)[0] if value else ""
        return settings

    def vigil(self, *args: str) -> str:
        """The operator's CLI on this stack (``vigil profiles ...``); its output. Raises on failure."""
        result = subprocess.run(
            [sys.executable, "-m", "vigil", *args],
            env={**self.env, **self.settings()},
            capture_output=True,
            text=True,
            cwd=repo_root(),
        )
        if result.returncode != 0:
            raise RuntimeError(f"vigil {' '.join(args)}: exit {result.returncode}: {result.stderr[-1500:]}")
        return result.stdout

    def _script_up(self) -> None:
        """The chaos script on the stack's scripted Messages API (a restarted one starts with the demo's)."""
        if self.script is None:
            return
        url = f"http://127.0.0.1:{self.ports.claude}/_script"
        request = urllib.request.Request(url, data=json.dumps(self.script).encode(), method="PUT")
        request.add_header("content-type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def down(self) -> None:
        for name in [*self.workers[1:], *self.dispatchers[1:]]:
            devstack.stop(self.pidfile(name))
        if self.root.exists():
            subprocess.run([sys.executable, "-m", "vigil_dev", "down"], env=self.env, capture_output=True)

    @property
    def dsns(self) -> list[str]:
        """The shards' URLs, shard 0 first, with the password `vigil-dev up` generated for this stack."""
        folders = ["pg", *(f"pg{n}" for n in range(1, len(self.shard_ports)))]
        return [
            devstack.PostgresServer(self.root / f / "data", port, tls=self.tls).url()
            for f, port in zip(folders, self.shard_ports)
        ]

    @property
    def ingest_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.ingest}"

    def api_token(self) -> str:
        return (self.root / "api_token").read_text().strip()

    def dispatcher_logs(self) -> list[Path]:
        return [self.root / "logs" / f"{name}.log" for name in self.dispatchers]

    # -- faults -----------------------------------------------------------------------

    def pidfile(self, part: str) -> Path:
        if part == "kafka":
            return self.root / "kafka" / "data" / "kafka.pid"
        if part == "postgres":
            return self.root / "pg" / "postgres.pid"
        if part.startswith("postgres-"):  # shard N's server
            return self.root / f"pg{part.removeprefix('postgres-')}" / "postgres.pid"
        return self.root / "pids" / f"{part}.pid"

    def pid(self, part: str) -> int | None:
        return devstack.read_pid(self.pidfile(part))

    def kill(self, part: str) -> bool:
        """SIGKILL ``part``'s whole process group (PostgreSQL: the server and its backends,
        as a crash takes them). False if it was not running."""
        pid = self.pid(part)
        if pid is None:
            return False
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        deadline = time.monotonic() + 10
        while devstack.pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    def kill_mcp(self, worker: str) -> int:
        """SIGKILL ``worker``'s MCP stdio servers (its child processes running the dev stack's
        MCP server), as a crash of the server alone; the worker's next call starts it again.
        How many were killed."""
        pid = self.pid(worker)
        killed = 0
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                command = (proc / "cmdline").read_bytes()
                if parent == pid and b"mcp_demo_server" in command:
                    os.kill(int(proc.name), signal.SIGKILL)
                    killed += 1
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        return killed

    def freeze(self, part: str, seconds: float) -> bool:
        """SIGSTOP ``part`` for ``seconds`` (past its session timeout), then SIGCONT."""
        pid = self.pid(part)
        if pid is None:
            return False
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed meanwhile (a poison call of a run it had: it woke first and died)
        return True

    def caller(self, port: int, peer: int | None = None) -> str | None:
        """The worker whose TCP connection to 127.0.0.1 comes from local ``port`` (to remote
        port ``peer``, when given; None: no worker's): the sockets' inodes from /proc/net/tcp,
        then the worker holding one among its descriptors. Entries owned by no process do not
        count (inode 0: a closed connection's TIME_WAIT, which an ephemeral port can share with
        a live one), nor, with ``peer``, those to another remote port: Linux gives one
        ephemeral port to connections to different peers, so another worker's connection to
        Kafka or PostgreSQL can share it (a short chaos run of 7 December killed the wrong
        worker so). Linux only, as the dev stack is."""
        inodes = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) != port or fields[9] == "0":
                continue
            if peer is not None and int(fields[2].rsplit(":", 1)[1], 16) != peer:
                continue
            inodes.add(f"socket:[{fields[9]}]")
        if not inodes:
            return None
        for worker in self.workers:
            pid = self.pid(worker)
            if pid is None:
                continue
            try:
                fds = list(Path(f"/proc/{pid}/fd").iterdir())
            except OSError:
                continue  # it died meanwhile
            for fd in fds:
                try:
                    if os.readlink(fd) in inodes:
                        return worker
                except OSError:
                    continue  # this descriptor closed meanwhile: the worker's others still count
        return None

    def held(self, worker: str) -> list[int] | None:
        """The partitions ``worker`` holds in the ledger (None if it cannot be read). The
        stack's own worker is named hostname-pid (the default instance id), the extra ones
        by the chaos stack."""
        pid = self.pid(worker)
        holder = f"chaos-{worker}" if worker in EXTRA_WORKERS else f"{socket.gethostname()}-{pid}"
        held: list[int] = []
        try:
            for dsn in self.dsns:
                with connect(dsn, autocommit=True, connect_timeout=5) as conn:
                    held += [r["partition"] for r in conn.execute(Q.chaos_held, {"holder": holder}).fetchall()]
        except (OSError, psycopg.Error):  # a measurement: the fault goes ahead without it
            return None
        return sorted(held)

    def port_of(self, name: str) -> int:
        return getattr(self.ports, name.replace("-", "_"))

    def ready(self) -> dict[str, bool]:
        """Each service's /readyz (Kafka and PostgreSQL reachable from it)."""
        names = ("ingest", *self.workers, "scheduler", *self.dispatchers)
        return {name: devstack.http_ok(f"http://127.0.0.1:{self.port_of(name)}/readyz", timeout=2) for name in names}


class Supervisor:
    """Brings a worker that a poison call killed back, as a process supervisor would
    (systemd's ``Restart=always``, Kubernetes' restart policy), on a thread of its own: the
    poison's endpoint kills the caller at once and returns, and the restart waits its turn
    with the nemesis's own (``stack.lock``)."""

    def __init__(self, stack: ChaosStack):
        self.stack = stack
        self.restarts = 0
        self._due = threading.Event()
        self._stopped = False
        self._busy = False  # a restart due or under way
        self._last = 0.0  # monotonic: when the last restart ended
        self._thread = threading.Thread(target=self._loop, name="chaos-supervisor", daemon=True)
        self._thread.start()

    def kill(self, worker: str) -> None:
        """SIGKILL ``worker`` now, and bring it back soon."""
        self._busy = True
        self.stack.kill(worker)
        self._due.set()

    def quiet(self, seconds: float) -> None:
        """Wait until no restart is due or under way, and the last ended ``seconds`` ago: the
        nemesis's next fault then does not fall on the moment a restarted worker takes its
        partitions over (and runs the lone last attempts its death left), which no supervisor's
        timing would make more likely than any other."""
        while not self._stopped and (self._busy or time.monotonic() - self._last < seconds):
            time.sleep(0.2)

    def stop(self) -> None:
        self._stopped = True
        self._due.set()
        self._thread.join(timeout=120)

    def _loop(self) -> None:
        while True:
            self._due.wait()
            if self._stopped:
                return
            self._due.clear()
            with self.stack.lock:
                if self._stopped:
                    return
                try:
                    self.stack.up()
                    self.restarts += 1
                except (RuntimeError, devstack.StackError) as exc:
                    # A start slower than up()'s wait (a loaded machine): try again, as
                    # Restart=always does; a supervisor that gave up stalled the whole run.
                    print(f"supervisor: {exc}; trying again", file=sys.stderr, flush=True)
                    self._due.set()
                finally:
                    self._last = time.monotonic()
                    self._busy = self._due.is_set()
            if self._due.is_set() and not self._stopped:
                time.sleep(2.0)
