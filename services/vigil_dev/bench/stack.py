"""The stack a benchmark runs on, and the isolated pieces each workload gets from it.

Without ``VIGIL_KAFKA_BOOTSTRAP`` and ``VIGIL_DATABASE_URL`` the bench starts its own Kafka
broker and PostgreSQL server (:mod:`vigil_dev.devstack`, the same processes `make up` runs) on
free ports in a temporary folder, and stops them at the end. With both set, it uses that
stack and touches nothing of it but what it creates: databases named ``vigil_bench_*`` and
topics named ``bench-*``, dropped again when the workload ends (also after a failure). Its
clients take ``VIGIL_KAFKA_OPT_*`` and the URL's TLS options like the services, so ``. .run/env``
of a ``VIGIL_DEV_SECURE=1`` stack runs the bench over SASL_SSL and TLS.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from vigil.bus.kafka import ensure_topics, quiet_admin
from vigil.ledger.db import SESSION_OPTIONS
from vigil.ledger.migrate import apply_canonical
from vigil.paths import repo_root
from vigil.settings import CommonSettings
from vigil_dev import broker, devstack


@dataclass
class Topics:
    events: str
    dlq: str
    deliveries: str
    partitions: int


@dataclass
class BenchStack:
    bootstrap: str
    admin_dsn: str  # the server's maintenance database, for CREATE/DROP DATABASE
    workdir: Path  # logs of the processes the bench starts
    kafka_version: str
    own: list = field(default_factory=list)  # servers this bench started (stopped at close)
    temp: Path | None = None
    statements: bool = False  # print each latency round's costliest statements (pg_stat_statements)

    @classmethod
    @contextlib.contextmanager
    def open(cls, keep_logs: bool = False, statements: bool = False) -> Iterator[BenchStack]:
        bootstrap = os.environ.get("VIGIL_KAFKA_BOOTSTRAP")
        database_url = os.environ.get("VIGIL_DATABASE_URL")
        temp = Path(tempfile.mkdtemp(prefix="vigil-bench-"))
        os.chmod(temp, 0o755)  # PostgreSQL runs as another account when we are root
        stack: BenchStack | None = None
        try:
            if bootstrap and database_url:
                stack = cls(
                    bootstrap,
                    # The stack's admin role where `. .run/env` names it: the bench creates databases.
                    psycopg.conninfo.make_conninfo(
                        os.environ.get("VIGIL_DEV_ADMIN_DATABASE_URL") or database_url, dbname="postgres"
                    ),
                    temp / "logs",
                    _local_kafka_version(),
                    temp=temp,
                )
            else:
                stack = cls._start_own(temp, statements)
            stack.statements = statements
            stack.workdir.mkdir(parents=True, exist_ok=True)
            yield stack
        finally:
            if stack is not None:
                for server in reversed(stack.own):
                    server.stop()
            if not keep_logs:
                shutil.rmtree(temp, ignore_errors=True)

    @classmethod
    def _start_own(cls, temp: Path, statements: bool = False) -> BenchStack:
        run_dir = Path(os.environ.get("VIGIL_DEV_RUN_DIR", repo_root() / ".run"))
        libs = broker.kafka_libs(run_dir / "kafka")
        kafka = broker.KafkaServer(temp / "kafka", devstack.free_port(), devstack.free_port(), libs)
        preload = ("pg_stat_statements",) if statements else ()
        pg = devstack.PostgresServer(temp / "pg" / "data", devstack.free_port(), durable=True, preload=preload)
        stack = cls(kafka.bootstrap, "", temp / "logs", _jar_version(libs), temp=temp)
        try:
            kafka.start()
            stack.own.append(kafka)
            pg.start()
            stack.own.append(pg)
        except BaseException:
            for server in reversed(stack.own):
                server.stop()
            raise
        stack.admin_dsn = pg.admin_url()
        return stack

    @property
    def settings(self) -> CommonSettings:
        return CommonSettings(kafka_bootstrap=self.bootstrap, database_url=self.admin_dsn)

    def dsn(self, database: str) -> str:
        return psycopg.conninfo.make_conninfo(self.admin_dsn, dbname=database)

    @contextlib.contextmanager
    def database(self, label: str = "") -> Iterator[str]:
        """A fresh empty database, ``vigil_bench_[label_]*``, dropped afterwards; its DSN."""
        name = f"vigil_bench_{label + '_' if label else ''}{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            yield self.dsn(name)
        finally:
            with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @contextlib.contextmanager
    def ledger(self) -> Iterator[str]:
        """A fresh ledger database (canonical schema), dropped afterwards; its DSN."""
        with self.database() as dsn:
            apply_canonical(dsn)
            yield dsn

    @contextlib.contextmanager
    def topics(self, partitions: int) -> Iterator[Topics]:
        """Fresh events, dead-letter and deliveries topics, deleted afterwards."""
        prefix = f"bench-{uuid.uuid4().hex[:10]}"
        names = Topics(f"{prefix}.events", f"{prefix}.dlq", f"{prefix}.deliveries", partitions)
        # The bench's broker is a single one: one copy.
        ensure_topics(self.settings, {names.events: partitions, names.dlq: 1, names.deliveries: 1}, replication=1)
        try:
            yield names
        finally:
            admin = quiet_admin(self.settings)  # alive until its futures settle
            futures = admin.delete_topics([names.events, names.dlq, names.deliveries], operation_timeout=30)
            for future in futures.values():
                with contextlib.suppress(Exception):
                    future.result(30)

    def durability(self) -> str:
        """The durability every figure is taken at, printed beside each one."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            sync_commit = conn.execute("SHOW synchronous_commit").fetchone()[0]
            fsync = conn.execute("SHOW fsync").fetchone()[0]
        return f"pg synchronous_commit={sync_commit} fsync={fsync}"

    def machine(self) -> list[str]:
        """What the figures were measured on, printed before them."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            pg_version = conn.execute("SHOW server_version").fetchone()[0]
            fsync = conn.execute("SHOW fsync").fetchone()[0]
            sync_commit = conn.execute("SHOW synchronous_commit").fetchone()[0]
        with psycopg.connect(self.admin_dsn, options=SESSION_OPTIONS, autocommit=True) as conn:
            session_commit = conn.execute("SHOW synchronous_commit").fetchone()[0]
        where = "started by the bench" if self.own else "external, named by VIGIL_*"
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        return [
            f"machine: {os.cpu_count()} cores ({_cpu_model()}), {_memory_gb():.1f} GB,"
            f" {platform.system()} {platform.release()}",
            f"python: {platform.python_version()} ({platform.python_implementation()})",
            f"postgresql: {pg_version} (fsync={fsync}, server synchronous_commit={sync_commit}; {where})",
            # Every figure, raw limits included, is taken at this: what vigil's sessions set.
            f"durability: synchronous_commit={session_commit} in every ledger session (vigil's and the raw"
            f" limits'); fsync={fsync}"
            + ("" if fsync == "on" else " (a process kill loses nothing; a machine crash may)"),
            f"kafka: {self.kafka_version} at {self.bootstrap} ({where})",
            f"load average at start: {load}",
        ]


def _jar_version(libs: Path) -> str:
    for jar in sorted(libs.glob("kafka_2.13-*.jar")):
        match = re.match(r"kafka_2\.13-(.+)\.jar$", jar.name)
        if match:
            return f"Apache Kafka {match.group(1)}"
    return "Apache Kafka (version unknown)"


def _local_kafka_version() -> str:
    # The wire protocol does not carry the broker's version; an external stack started by
    # `make up` runs the jars cached under .run/kafka/libs, so report those when present.
    libs = Path(os.environ.get("VIGIL_DEV_RUN_DIR", repo_root() / ".run")) / "kafka" / "libs"
    if libs.is_dir():
        return _jar_version(libs) + " (jars in .run/kafka/libs)"
    return "external broker (version not reported by the protocol)"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _memory_gb() -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 / 1024
    return 0.0
