"""The test session's real Kafka broker and PostgreSQL server, and per-test isolation.

If ``VIGIL_KAFKA_BOOTSTRAP`` and ``VIGIL_DATABASE_URL`` are both set, the suite uses that
stack (for example the one ``make up`` started: ``. .run/env && make test``). Otherwise it
starts its own broker and database on free ports in a temporary folder and stops them at
the end.

Databases are created and dropped by the admin role (``VIGIL_DEV_ADMIN_DATABASE_URL``, which
``make up`` writes to .run/env; else ``VIGIL_DATABASE_URL``'s own role) and owned by the
services' role, the one ``VIGIL_DATABASE_URL`` names, which is what every test connects as.

Isolation: every test gets a fresh database cloned from a template (the canonical schema,
built once per session) and its own topic names, consumer group and ports, so tests never
see each other's events, and several test sessions can share one stack.

In parallel (``pytest -n N``, what ``make test`` runs), the controlling process starts the
broker and the server once, before the workers exist, and names them to the workers: one JVM
and one PostgreSQL for the whole run, each worker with its own template database.
``devstack.free_port`` gives each worker ports of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from cryptography.fernet import Fernet
from psycopg import sql

from support import VigilProcess
from vigil.ledger.migrate import apply_canonical
from vigil.paths import repo_root
from vigil_dev import broker, devstack

# Only the stack's address comes from the caller's environment (`. .run/env && make test`):
# every other VIGIL_ setting the services read is the test's own choice, so a developer's
# shell (say, a short approval deadline for the demo) never changes what a test checks.
# The model test's own knobs (tests/test_ledger_model.py: how many examples, which seed) are
# kept too: no service reads them.
KEPT = {
    "VIGIL_KAFKA_BOOTSTRAP",
    "VIGIL_DATABASE_URL",
    "VIGIL_DEV_RUN_DIR",
    "VIGIL_DEV_ADMIN_DATABASE_URL",
    "VIGIL_MODEL_EXAMPLES",
    "VIGIL_MODEL_STEPS",
    "VIGIL_MODEL_SEED",
    "VIGIL_MODEL_SHRINK",
}
# A parallel run's worker: the stack its controller started (pytest_configure), taken out of
# the environment so that the worker's tests and their processes see what a serial run's do.
RUN_STACK = json.loads(os.environ.pop("VIGIL_TEST_RUN_STACK", "null"))
for _name in list(os.environ):
    if (_name.startswith("VIGIL_") and _name not in KEPT) or _name.startswith("ANTHROPIC_"):
        del os.environ[_name]
# The session's broker is a single one: topics are created with one copy.
os.environ["VIGIL_TOPIC_REPLICATION"] = "1"

# The tests' webhook receivers and HTTP servers listen on 127.0.0.1, which outbound HTTP
# refuses unless allowed (issue 16); the security tests build their own stricter policy.
os.environ["VIGIL_OUTBOUND_ALLOWED_NETS"] = "127.0.0.0/8,::1/128"
# Hook and channel secrets are sealed in every test, as on a stack `make up` started; the
# processes the tests start inherit the key.
os.environ["VIGIL_SECRET_KEY"] = Fernet.generate_key().decode()


@dataclass
class Stack:
    bootstrap: str
    admin_dsn: str  # the server's maintenance database as the admin role, for CREATE/DROP DATABASE
    service_url: str  # the services' role (VIGIL_DATABASE_URL): what tests and services connect as
    kafka: broker.KafkaServer | None = None  # set when this session owns the broker
    template: str = field(default_factory=lambda: f"vigil_tpl_{uuid.uuid4().hex[:8]}")

    def dsn(self, database: str) -> str:
        return psycopg.conninfo.make_conninfo(self.service_url, dbname=database)

    def create_database(self, conn: psycopg.Connection, name: str, template: str | None = None) -> None:
        """CREATE DATABASE as the admin role, owned by the services' role (objects cloned from
        the template keep their owner: the services' role, which built it)."""
        owner = psycopg.conninfo.conninfo_to_dict(self.service_url).get("user")
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        if owner and owner != psycopg.conninfo.conninfo_to_dict(self.admin_dsn).get("user"):
            statement += sql.SQL(" OWNER {}").format(sql.Identifier(owner))
        conn.execute(statement)


def _admin_dsn(url: str) -> str:
    return psycopg.conninfo.make_conninfo(url, dbname="postgres")


class OwnStack:
    """A broker and a server of this test run's own, on free ports in a temporary folder."""

    def __init__(self) -> None:
        # Not under pytest's basetemp: pytest resets that folder to mode 700 whenever another
        # session starts, and PostgreSQL runs as another account that must reach its data.
        self.root = Path(tempfile.mkdtemp(prefix="vigil-test-stack-"))
        os.chmod(self.root, 0o755)
        libs = broker.kafka_libs(Path(os.environ.get("VIGIL_DEV_RUN_DIR", repo_root() / ".run")) / "kafka")
        self.kafka = broker.KafkaServer(self.root / "kafka", devstack.free_port(), devstack.free_port(), libs)
        self.pg = devstack.PostgresServer(self.root / "pg" / "data", devstack.free_port())

    def start(self) -> OwnStack:
        try:
            # The server starts while the JVM does: the broker's start is most of the wait.
            with ThreadPoolExecutor(2) as pool:
                for started in [pool.submit(thing.start) for thing in (self.kafka, self.pg)]:
                    started.result()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for thing in (self.pg, self.kafka):  # both, whether or not its start returned
            thing.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    bootstrap = os.environ.get("VIGIL_KAFKA_BOOTSTRAP")
    database_url = os.environ.get("VIGIL_DATABASE_URL")
    own: OwnStack | None = None
    if bootstrap and database_url:
        # A developer's stack (`. .run/env`): used as it is, never stopped.
        admin = os.environ.get("VIGIL_DEV_ADMIN_DATABASE_URL") or database_url
        st = Stack(bootstrap=bootstrap, admin_dsn=_admin_dsn(admin), service_url=database_url)
    elif RUN_STACK:
        # A parallel run's worker: the run's own stack, which its controller stops.
        given = RUN_STACK["kafka"]
        kafka = broker.KafkaServer(
            Path(given["data_dir"]), given["port"], given["controller_port"], Path(given["libs"])
        )
        st = Stack(bootstrap=kafka.bootstrap, admin_dsn=RUN_STACK["admin_dsn"], service_url=RUN_STACK["service_url"])
        st.kafka = kafka
    else:
        own = OwnStack().start()
        st = Stack(bootstrap=own.kafka.bootstrap, admin_dsn=own.pg.admin_url(), service_url=own.pg.url())
        st.kafka = own.kafka
    os.environ["VIGIL_TEST_ADMIN_DSN"] = st.admin_dsn  # support.explaining: plans need a superuser
    with psycopg.connect(st.admin_dsn, autocommit=True) as conn:
        st.create_database(conn, st.template)
    apply_canonical(st.dsn(st.template))
    try:
        yield st
    finally:
        with psycopg.connect(st.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{st.template}" WITH (FORCE)')
        if own is not None:
            own.stop()


@contextmanager
def fresh_ledger(stack: Stack) -> Iterator[str]:
    """A fresh ledger database (a copy of the template), dropped afterwards; its DSN."""
    name = f"vigil_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
        stack.create_database(conn, name, stack.template)
    try:
        yield stack.dsn(name)
    finally:
        with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def ledger(stack: Stack) -> Iterator[str]:
    """A fresh ledger database for this test; its DSN."""
    with fresh_ledger(stack) as dsn:
        yield dsn


@dataclass
class Topics:
    events: str
    dlq: str
    deliveries: str
    partitions: int


@contextmanager
def fresh_topics(stack: Stack, count: int = 4) -> Iterator[Topics]:
    """Topics of their own (the events topic with ``count`` partitions), deleted afterwards."""
    from confluent_kafka.admin import AdminClient

    from vigil.bus.kafka import ensure_topics
    from vigil.settings import CommonSettings

    prefix = f"t{uuid.uuid4().hex[:10]}"
    names = Topics(f"{prefix}.events", f"{prefix}.dlq", f"{prefix}.deliveries", count)
    settings = CommonSettings(kafka_bootstrap=stack.bootstrap)
    ensure_topics(settings, {names.events: count, names.dlq: 1, names.deliveries: 1})
    yield names
    AdminClient({"bootstrap.servers": stack.bootstrap}).delete_topics([names.events, names.dlq, names.deliveries])


@pytest.fixture
def topics(stack: Stack, request) -> Iterator[Topics]:
    """Topics of this test only. ``@pytest.mark.partitions(n)`` sets the events topic's count."""
    marker = request.node.get_closest_marker("partitions")
    with fresh_topics(stack, marker.args[0] if marker else 4) as names:
        yield names


@pytest.fixture
def vigil_env(stack: Stack, ledger: str, topics: Topics) -> dict[str, str]:
    """VIGIL_* settings that point a service process at this test's ledger and topics."""
    return service_env(stack, ledger, topics)


def service_env(stack: Stack, ledger: str, topics: Topics) -> dict[str, str]:
    """VIGIL_* settings that point a service process at ``ledger`` and ``topics``, each
    service on a free port."""
    from vigil_dev.devstack import free_port

    return {
        "VIGIL_KAFKA_BOOTSTRAP": stack.bootstrap,
        "VIGIL_DATABASE_URL": ledger,
        "VIGIL_EVENTS_TOPIC": topics.events,
        "VIGIL_DLQ_TOPIC": topics.dlq,
        "VIGIL_DELIVERIES_TOPIC": topics.deliveries,
        "VIGIL_PARTITIONS": str(topics.partitions),
        "VIGIL_WORKER_GROUP": f"{topics.events}.workers",
        "VIGIL_INGEST_PORT": str(free_port()),
        "VIGIL_WORKER_PORT": str(free_port()),
        "VIGIL_SCHEDULER_PORT": str(free_port()),
        "VIGIL_DISPATCHER_PORT": str(free_port()),
        "VIGIL_LOG_LEVEL": "INFO",
        "VIGIL_APPROVAL_SECRET": "test-approval-secret",
    }


class Spawner:
    """Starts ``vigil <args>`` processes with their logs under ``folder``; stops them all."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.started: list[VigilProcess] = []

    def __call__(self, args: list[str], env: dict[str, str], name: str | None = None) -> VigilProcess:
        label = name or f"{args[0]}-{len(self.started)}"
        proc = VigilProcess(args, env, self.folder / f"{label}.log").start()
        self.started.append(proc)
        return proc

    def stop_all(self, show_logs: bool) -> None:
        for proc in self.started:
            proc.stop()
        if show_logs:
            for proc in self.started:
                print(f"\n----- log of vigil {' '.join(proc.args)} ({proc.log_path}) -----\n{proc.log()[-6000:]}")


@pytest.fixture
def spawn(tmp_path, request):
    """Start ``vigil <args>`` processes; all of them are stopped when the test ends.

    On failure the processes' logs are attached to the report.
    """
    spawner = Spawner(tmp_path / "logs")
    yield spawner
    spawner.stop_all(getattr(request.node, "rep_call_failed", False))


@pytest.fixture(scope="module")
def module_stack(stack: Stack, tmp_path_factory, request) -> Iterator[tuple[dict[str, str], Spawner]]:
    """One ledger, one set of topics and one process starter for a whole module, for tests
    that probe the same running services (``service_env``'s settings); the processes stop
    when the module ends, with their logs shown if any test of the session failed meanwhile."""
    failed_before = request.session.testsfailed
    with fresh_ledger(stack) as dsn, fresh_topics(stack) as names:
        spawner = Spawner(tmp_path_factory.mktemp("logs"))
        try:
            yield service_env(stack, dsn, names), spawner
        finally:
            spawner.stop_all(request.session.testsfailed > failed_before)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.rep_call_failed = report.failed


def _parallel_controller(config) -> bool:
    """This process runs no test itself but starts pytest-xdist's workers (``-n N``, N > 0)."""
    return not hasattr(config, "workerinput") and (getattr(config.option, "numprocesses", None) or 0) > 0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """In a parallel run, the controller starts the broker and the server before the workers
    exist (xdist starts them at the session's start, after this), and names them to the
    workers through the environment they inherit (``VIGIL_TEST_RUN_STACK``, read by
    :func:`stack`). Stopped in :func:`pytest_unconfigure`."""
    given = os.environ.get("VIGIL_KAFKA_BOOTSTRAP") and os.environ.get("VIGIL_DATABASE_URL")
    if _parallel_controller(config) and not given and not config.option.collectonly:
        own = OwnStack().start()
        config.stash[_OWN_STACK] = own
        kafka = own.kafka
        os.environ["VIGIL_TEST_RUN_STACK"] = json.dumps(
            {
                "admin_dsn": own.pg.admin_url(),
                "service_url": own.pg.url(),
                "kafka": {
                    "data_dir": str(kafka.data_dir),
                    "port": kafka.port,
                    "controller_port": kafka.controller_port,
                    "libs": str(kafka.libs),
                },
            }
        )
    config.addinivalue_line("markers", "partitions(n): partition count of the test's events topic")
    config.addinivalue_line(
        "markers",
        "stack: uses a Kafka broker or PostgreSQL: the session's (set from the test's fixtures) or its own (by hand)",
    )


def pytest_collection_modifyitems(items):
    """Mark every test whose fixtures reach the session's stack, so that ``-m "not stack"``
    (``make test-fast``) runs the tests that start no broker and no database. Read from the
    fixtures, not written by hand, so the mark follows what a test really uses; the few tests
    that start a broker or a database of their own carry the mark by hand."""
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.stack)
    # The longest tests first: pytest-xdist hands tests out in this order, and a long one
    # handed out last would run alone while the other workers sit idle.
    items.sort(key=lambda item: item.get_closest_marker("early") is None)


_OWN_STACK = pytest.StashKey[OwnStack]()


def pytest_unconfigure(config):
    own = config.stash.get(_OWN_STACK, None)
    if own is not None:
        os.environ.pop("VIGIL_TEST_RUN_STACK", None)
        own.stop()


@pytest.fixture
def exporter(monkeypatch):
    """Traces on, every finished span kept in the SDK's in-memory exporter: what an LLM
    observability tool reads."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vigil import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "enabled", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    return exporter


@pytest.fixture
def otlp(monkeypatch):
    """Traces on, exported as a service exports them (the provider ``tracing.setup`` installs:
    its sampler, its batching OTLP/HTTP exporter, ``OTEL_EXPORTER_OTLP_ENDPOINT``) to a real
    OTLP receiver in this process; ``otlp.flush()`` before reading what it was sent. In-process:
    the exporter is the subject, not a service's process."""
    from otlp_support import OtlpReceiver
    from vigil import tracing

    with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        provider = tracing.exporting_provider("worker")
        monkeypatch.setattr(tracing, "enabled", True)
        monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("vigil"))
        receiver.flush = provider.force_flush
        yield receiver
        provider.shutdown()
