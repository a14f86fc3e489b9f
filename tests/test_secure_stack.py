"""The secure dev stack (`VIGIL_DEV_SECURE=1 make up`): Kafka with only a SASL_SSL listener
(SCRAM-SHA-512, a user per service) and PostgreSQL with TLS only (`hostssl`, clients
`sslmode=verify-full` against the stack's CA). Every part runs on it through the settings
production uses (VIGIL_KAFKA_OPT_*, the database URL's sslmode and sslrootcert), and the
broker and the database refuse whoever comes without them.

One stack for the module, started and stopped through `vigil-dev up` / `down` as `make up` does."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from support import REPO, SERVICE_PORTS, STACK_PORTS, dev_env, stack_settings, wait_for
from vigil.bus.codec import DELIVERY_SCHEMA_NAME, AvroCodec
from vigil_dev import broker, devstack
from vigil_dev.tls import LocalTLS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.stack,  # starts a stack of its own
    # A broker, a database and five services started on a busy 2-core machine, then a timer
    # that fires five seconds after the agent sets it.
    pytest.mark.timeout(420),
    # One worker runs the module: its stack starts once (make suite runs --dist loadgroup).
    pytest.mark.xdist_group("secure_stack"),
]


@dataclass
class SecureStack:
    root: Path
    env: dict[str, str]  # what `vigil-dev` runs with
    settings: dict[str, str]  # the stack's .run/env: what `. .run/env` gives a shell

    def kafka_options(self, **overrides: str) -> dict[str, str]:
        """librdkafka settings from the stack's VIGIL_KAFKA_OPT_* (the admin user), as vigil maps them."""
        prefix = "VIGIL_KAFKA_OPT_"
        options = {
            name.removeprefix(prefix).lower().replace("_", "."): value
            for name, value in self.settings.items()
            if name.startswith(prefix)
        }
        return {"bootstrap.servers": self.settings["VIGIL_KAFKA_BOOTSTRAP"], **options, **overrides}

    def vigil(self, *args: str) -> subprocess.CompletedProcess:
        """The operator's CLI in a shell that sourced the stack's .run/env."""
        return subprocess.run(
            [sys.executable, "-m", "vigil", *args],
            env={**self.env, **self.settings},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )


def _vigil_dev(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vigil_dev", *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
    )


@pytest.fixture(scope="module")
def secure() -> Iterator[SecureStack]:
    root = Path(tempfile.mkdtemp(prefix="vigil-secure-"))
    os.chmod(root, 0o755)  # PostgreSQL runs as another account when we are root
    ports = {name: devstack.free_port() for name in (*STACK_PORTS, *SERVICE_PORTS)}
    env = {**dev_env(root, ports), "VIGIL_DEV_SECURE": "1", "VIGIL_OUTBOX_GAP": "0"}
    try:
        up = _vigil_dev(env, "up")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "SASL_SSL SCRAM-SHA-512" in up.stdout and "sslmode=verify-full" in up.stdout, up.stdout
        yield SecureStack(root, env, stack_settings(root / "env"))
    finally:
        _vigil_dev(env, "down")
        shutil.rmtree(root, ignore_errors=True)


def test_settings_name_the_secure_parts(secure):
    settings = secure.settings
    assert settings["VIGIL_DEV_SECURE"] == "1"  # a shell that sourced it starts this same stack again
    assert settings["VIGIL_KAFKA_OPT_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert settings["VIGIL_KAFKA_OPT_SASL_MECHANISMS"] == "SCRAM-SHA-512"
    assert settings["VIGIL_KAFKA_OPT_SASL_USERNAME"] == "admin"
    assert settings["VIGIL_KAFKA_OPT_SSL_CA_LOCATION"] == str(secure.root / "tls" / "ca.pem")
    url = psycopg.conninfo.conninfo_to_dict(settings["VIGIL_DATABASE_URL"])
    assert url["sslmode"] == "verify-full" and url["sslrootcert"] == str(secure.root / "tls" / "ca.pem")
    # Each service its own user: the broker's log names who connected.
    users = {u for u in broker.SERVICE_KAFKA_USERS if u != "console"}
    log = (secure.root / "kafka" / "data" / "kafka.log").read_text(errors="replace")
    for name in users:
        password = (secure.root / "kafka" / "data" / "scram" / f"{name}.password").read_text().strip()
        assert password not in log and password not in (secure.root / "logs" / f"{name}.log").read_text()


def test_chat_to_timer_to_kafka_delivery_and_the_console_on_the_secure_stack(secure):
    """ingest takes a chat message, the worker runs it with the scripted model, which sets a
    timer; the scheduler fires it, the worker runs again, and the dispatcher delivers both
    replies on the user's Kafka channel; the CLI and the console read the ledger over TLS."""
    user = f"secure-{uuid.uuid4().hex[:6]}"
    channel = secure.vigil("channels", "set", user, "--type", "kafka", "--gap", "0")
    assert channel.returncode == 0, channel.stderr

    consumer = Consumer(secure.kafka_options(**{"group.id": f"secure-test-{user}", "auto.offset.reset": "earliest"}))
    topic = secure.settings["VIGIL_DELIVERIES_TOPIC"]
    consumer.subscribe([topic])
    token = secure.settings["VIGIL_API_TOKEN"]
    ingest = f"http://127.0.0.1:{secure.settings['VIGIL_INGEST_PORT']}"
    try:
        answer = httpx.post(
            f"{ingest}/v1/users/{user}/messages",
            json={"text": "remind me in 5 seconds to stretch"},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": uuid.uuid4().hex},
            timeout=30,
        )
        assert answer.status_code == 202, answer.text
        codec = AvroCodec(DELIVERY_SCHEMA_NAME)
        delivered: list[str] = []

        def reminder_delivered() -> bool:
            message = consumer.poll(0.5)
            if message is not None and not message.error() and message.key() == user.encode():
                delivered.extend(codec.decode_record(message.value())["messages"])
            return any(text.startswith("Reminder:") for text in delivered)

        wait_for(reminder_delivered, 120, "the timer's reminder on the user's Kafka channel")
        assert delivered[0] == "OK, I will remind you.", delivered
    finally:
        consumer.close()

    inbox = secure.vigil("inbox", user, "--json")
    assert inbox.returncode == 0, inbox.stderr
    sources = sorted(json.loads(line)["source"] for line in inbox.stdout.splitlines())
    assert sources == ["chat", "timer"], inbox.stdout

    console = f"http://127.0.0.1:{secure.settings['VIGIL_CONSOLE_PORT']}"
    page = httpx.get(f"{console}/users/{user}", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert page.status_code == 200 and "Reminder: you asked me" in page.text, page.status_code


def test_the_broker_refuses_plaintext_and_a_wrong_password(secure):
    events = secure.settings["VIGIL_EVENTS_TOPIC"]
    stored_before = _stored(secure, events)
    plaintext = {"bootstrap.servers": secure.settings["VIGIL_KAFKA_BOOTSTRAP"]}
    wrong_password = secure.kafka_options(**{"sasl.username": "worker", "sasl.password": "not-the-password"})
    errors: dict[str, list[KafkaError]] = {"plaintext": [], "wrong password": []}
    outcomes: dict[str, list[KafkaError | None]] = {name: [] for name in errors}
    producers = {
        name: Producer({**config, "message.timeout.ms": 3000, "error_cb": errors[name].append, "log_level": 0})
        for name, config in (("plaintext", plaintext), ("wrong password", wrong_password))
    }
    for name, producer in producers.items():  # both at once: each waits out its message timeout
        producer.produce(
            events, b"forged", key=b"mallory", on_delivery=lambda err, _msg, n=name: outcomes[n].append(err)
        )
    for name, producer in producers.items():
        producer.flush(15)
        assert len(outcomes[name]) == 1 and outcomes[name][0] is not None, f"{name}: the broker acknowledged it"
    refused = {name: {err.code() for err in found} for name, found in errors.items()}
    # librdkafka cannot speak to a TLS port in plain: it never gets a broker to answer.
    assert KafkaError._ALL_BROKERS_DOWN in refused["plaintext"], refused
    assert KafkaError._AUTHENTICATION in refused["wrong password"], refused
    assert _stored(secure, events) == stored_before


def _stored(secure: SecureStack, topic: str) -> int:
    """How many records the topic holds (its partitions' high watermarks), read as the admin user."""
    consumer = Consumer(secure.kafka_options(**{"group.id": "secure-test-watermarks"}))
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions)
    finally:
        consumer.close()


def test_postgresql_refuses_a_connection_without_tls(secure):
    url = secure.settings["VIGIL_DATABASE_URL"]
    with psycopg.connect(url) as conn:
        assert conn.info.pgconn.ssl_in_use
    plain = psycopg.conninfo.make_conninfo(url, sslmode="disable")
    with pytest.raises(psycopg.OperationalError, match="no pg_hba.conf entry .* no encryption"):
        psycopg.connect(plain, connect_timeout=10).close()
    # A client that trusts another CA refuses the server: verify-full checks the certificate.
    other_ca = LocalTLS(secure.root / "other-tls").ensure().ca
    with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
        psycopg.connect(psycopg.conninfo.make_conninfo(url, sslrootcert=str(other_ca)), connect_timeout=10).close()


# Kafka's ApiVersions request, v0, correlation id 1, client id "probe": any Kafka port answers it.
API_VERSIONS = bytes.fromhex("0000000f00120000000000010005") + b"probe"


def _kafka_answers(sock: socket.socket) -> bool:
    """Whether a Kafka port answers ApiVersions on ``sock``: a response (its size, then the
    request's correlation id), not a TLS alert or a closed connection."""
    sock.settimeout(10)
    sock.sendall(API_VERSIONS)
    answer = b""
    try:
        while len(answer) < 8 and (chunk := sock.recv(8 - len(answer))):
            answer += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return len(answer) == 8 and answer[4:8] == (1).to_bytes(4, "big")


def test_no_port_of_the_broker_answers_without_tls_and_the_controller_wants_a_certificate(secure):
    tls_dir = secure.root / "tls"
    for variable in ("VIGIL_DEV_KAFKA_PORT", "VIGIL_DEV_KAFKA_CONTROLLER_PORT"):
        with socket.create_connection(("127.0.0.1", int(secure.env[variable])), timeout=10) as plain:
            assert not _kafka_answers(plain), f"{variable} answered a PLAINTEXT request"
    controller = ("127.0.0.1", int(secure.env["VIGIL_DEV_KAFKA_CONTROLLER_PORT"]))
    context = ssl.create_default_context(cafile=str(tls_dir / "ca.pem"))
    with context.wrap_socket(socket.create_connection(controller, timeout=10), server_hostname="127.0.0.1") as anon:
        assert not _kafka_answers(anon), "the controller answered a client without a certificate"
    # The same with the stack's certificate: the refusal above was for the missing certificate.
    context.load_cert_chain(tls_dir / "server.pem", tls_dir / "server.key")
    with context.wrap_socket(socket.create_connection(controller, timeout=10), server_hostname="127.0.0.1") as known:
        assert _kafka_answers(known)
