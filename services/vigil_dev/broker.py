"""The local stack's Kafka broker: Apache Kafka (KRaft, one node) as a plain process, started
from the jars Maven fetches into ``.run/kafka/libs`` (see deploy/local/pom.xml), PLAINTEXT or,
for the secure stack, SASL_SSL only."""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from vigil.paths import repo_root
from vigil_dev.devstack import (
    START_TIMEOUT_S,
    StackError,
    kept_secret,
    port_open,
    read_pid,
    spawn,
    stop,
    wait_until,
)
from vigil_dev.tls import LocalTLS, write_file

log = logging.getLogger(__name__)

KAFKA_MAIN = "kafka.Kafka"
# The JVM defaults to a quarter of the machine's memory; a dev broker needs far less.
KAFKA_HEAP = "-Xmx768m"


def kafka_libs(cache_dir: Path) -> Path:
    """The broker's jars, fetched from Maven Central once and cached (under a lock: parallel
    test workers may ask at once)."""
    libs = cache_dir / "libs"
    if list(libs.glob("kafka_2.13-*.jar")):
        return libs
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if list(libs.glob("kafka_2.13-*.jar")):
            return libs
        return _fetch_kafka_libs(libs)


def _fetch_kafka_libs(libs: Path) -> Path:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven (mvn) is needed to fetch the Kafka broker: apt-get install maven")
    pom = repo_root() / "deploy" / "local" / "pom.xml"
    log.info("fetching the Kafka broker jars from Maven Central into %s", libs)
    # Into a folder beside it, renamed when complete: whoever sees libs/ sees every jar.
    partial = libs.with_name(libs.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    result = subprocess.run(
        [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies", f"-DoutputDirectory={partial}"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0 or not list(partial.glob("kafka_2.13-*.jar")):
        raise StackError(f"fetching Kafka with Maven failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)
    return libs


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError("Java 17+ is needed to run the Kafka broker: apt-get install openjdk-17-jre-headless")
    return java


# The secure broker's SCRAM-SHA-512 users: the broker itself (between its listeners), one per
# service, and ``admin`` for the operator's CLI (`vigil topics`, `. .run/env`) and the tooling.
SCRAM_MECHANISM = "SCRAM-SHA-512"
BROKER_USER = "broker"
ADMIN_KAFKA_USER = "admin"
SERVICE_KAFKA_USERS = ("ingest", "worker", "scheduler", "dispatcher", "console")
SCRAM_USERS = (BROKER_USER, ADMIN_KAFKA_USER, *SERVICE_KAFKA_USERS)


@dataclass
class KafkaServer:
    """A one-node KRaft broker. With ``tls`` (the secure stack) its one client listener is
    SASL_SSL, SCRAM-SHA-512 with a user per service (passwords kept in ``scram/<user>.password``,
    bootstrapped into the metadata when the storage is formatted), and its controller listener
    is TLS with a client certificate required, so no port of it takes an unauthenticated client."""

    data_dir: Path
    port: int
    controller_port: int
    libs: Path
    tls: LocalTLS | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "kafka.pid"

    @property
    def logfile(self) -> Path:
        return self.data_dir / "kafka.log"

    def password(self, user: str) -> str:
        return kept_secret(self.data_dir / "scram" / f"{user}.password")

    def client_options(self, user: str = ADMIN_KAFKA_USER) -> dict[str, str]:
        """librdkafka settings (beyond ``bootstrap.servers``) of a client connecting as ``user``;
        none for a PLAINTEXT broker. As ``VIGIL_KAFKA_OPT_*`` they are :meth:`client_env`."""
        if self.tls is None:
            return {}
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanisms": SCRAM_MECHANISM,
            "sasl.username": user,
            "sasl.password": self.password(user),
            "ssl.ca.location": str(self.tls.ca),
            # librdkafka's default since 1.9, written out: the broker's name is checked too.
            "ssl.endpoint.identification.algorithm": "https",
        }

    def client_env(self, user: str = ADMIN_KAFKA_USER) -> dict[str, str]:
        """:meth:`client_options` as the services read them (``VIGIL_KAFKA_OPT_SASL_USERNAME``...)."""
        return {
            "VIGIL_KAFKA_OPT_" + name.upper().replace(".", "_"): value
            for name, value in self.client_options(user).items()
        }

    def properties(self) -> str:
        return "\n".join([*self._listeners(), *self._common_properties()])

    def _listeners(self) -> list[str]:
        controller = f"CONTROLLER://127.0.0.1:{self.controller_port}"
        if self.tls is None:
            return [
                f"listeners=PLAINTEXT://127.0.0.1:{self.port},{controller}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name=PLAINTEXT",
            ]
        jaas = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{BROKER_USER}" password="{self.password(BROKER_USER)}";'
        )
        return [
            f"listeners=SASL_SSL://127.0.0.1:{self.port},{controller}",
            f"advertised.listeners=SASL_SSL://127.0.0.1:{self.port}",
            # KRaft keeps SCRAM credentials in its metadata, so the controller cannot use them:
            # its listener takes TLS with a client certificate from the stack's CA instead.
            "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "inter.broker.listener.name=SASL_SSL",
            f"sasl.enabled.mechanisms={SCRAM_MECHANISM}",
            f"sasl.mechanism.inter.broker.protocol={SCRAM_MECHANISM}",
            f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}.sasl.jaas.config={jaas}",
            "listener.name.controller.ssl.client.auth=required",
            "ssl.keystore.type=PEM",
            f"ssl.keystore.location={self.tls.keystore}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={self.tls.ca}",
            "ssl.endpoint.identification.algorithm=https",
        ]

    def _common_properties(self) -> list[str]:
        return [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
            "controller.listener.names=CONTROLLER",
            f"log.dirs={self.data_dir / 'log'}",
            # One broker: every internal topic at replication factor 1.
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=10",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            # No waiting for more members before the first rebalance: tests and the demo
            # start one worker at a time.
            "group.initial.rebalance.delay.ms=0",
            # Lets tests use short consumer session timeouts for failover scenarios.
            "group.min.session.timeout.ms=1000",
            # Topics are created on purpose (`vigil topics`), never by a typo'd consumer.
            "auto.create.topics.enable=false",
            "num.partitions=1",
            "",
        ]

    def _scram_arguments(self) -> list[str]:
        """``kafka-storage format``'s ``--add-scram`` for each user: the credentials exist
        before the broker first listens."""
        if self.tls is None:
            return []
        return [
            arg
            for user in SCRAM_USERS
            for arg in ("--add-scram", f"{SCRAM_MECHANISM}=[name={user},password={self.password(user)}]")
        ]

    def start(self) -> None:
        if read_pid(self.pidfile) is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        formatted = (self.data_dir / "log" / "meta.properties").exists()
        if self.tls is not None and formatted and not (self.data_dir / "scram").exists():
            raise StackError(
                f"{self.data_dir} was formatted without SCRAM users (a PLAINTEXT stack): stop the stack "
                f"(`vigil-dev down`), remove {self.data_dir} and start it again with VIGIL_DEV_SECURE=1"
            )
        config = self.data_dir / "server.properties"
        write_file(config, self.properties().encode(), 0o600)  # the secure broker's holds its SCRAM password
        java = java_binary()
        classpath = str(self.libs / "*")
        if not formatted:
            result = subprocess.run(
                [
                    java,
                    "-cp",
                    classpath,
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    uuid.uuid4().hex[:22],
                    "-c",
                    str(config),
                    *self._scram_arguments(),
                ],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise StackError(f"formatting KRaft storage failed: {result.stdout}{result.stderr}")
        if port_open(self.port):
            raise StackError(f"port {self.port} is taken by another process; set VIGIL_DEV_KAFKA_PORT")
        log4j = repo_root() / "deploy" / "local" / "log4j2.properties"
        spawn(
            [java, KAFKA_HEAP, f"-Dlog4j2.configurationFile={log4j}", "-cp", classpath, KAFKA_MAIN, str(config)],
            self.logfile,
            self.pidfile,
        )
        wait_until(self.ready, START_TIMEOUT_S, "Kafka", self.logfile)

    def ready(self) -> bool:
        if read_pid(self.pidfile) is None:
            raise StackError("Kafka exited:\n" + "\n".join(self.logfile.read_text(errors="replace").splitlines()[-30:]))
        if not port_open(self.port):
            return False
        from confluent_kafka.admin import AdminClient

        try:
            AdminClient({"bootstrap.servers": self.bootstrap, **self.client_options()}).list_topics(timeout=2)
            return True
        except Exception:
            return False

    def stop(self) -> bool:
        return stop(self.pidfile, timeout=30.0)
