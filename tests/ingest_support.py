"""Helpers of the ingest tests: an ingest server for this test, tokens, reading the topic."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
from click.testing import CliRunner
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from psycopg.rows import dict_row

from embedded_ingest import EmbeddedIngest
from vigil.bus.codec import EventCodec
from vigil.envelope import Event
from vigil.ingest.settings import IngestSettings
from vigil.ledger import approvals
from vigil.ledger.queries import Q
from vigil_dev.devstack import free_port

APPROVAL_SECRET = "test-approval-secret"
USER = "u-refunds"


def ingest_settings(bootstrap: str, dsn: str, topic: str, **overrides: Any) -> IngestSettings:
    values = {
        "kafka_bootstrap": bootstrap,
        "database_url": dsn,
        "events_topic": topic,
        "approval_secret": APPROVAL_SECRET,
        "ingest_port": free_port(),
        "produce_timeout_s": 5.0,
        **overrides,
    }
    return IngestSettings(**values)


def start_ingest(stack, ledger: str, topics, **overrides: Any) -> EmbeddedIngest:
    app_options = {k: overrides.pop(k) for k in list(overrides) if k in ("before_answer",)}
    return EmbeddedIngest(ingest_settings(stack.bootstrap, ledger, topics.events, **overrides), **app_options).start()


class TracebackWatch(logging.Handler):
    """Every record at ERROR or carrying a traceback, from the root logger and from uvicorn's
    (which does not propagate to the root, so pytest's caplog never sees its "Exception in
    ASGI application")."""

    LOGGERS = ("", "uvicorn")

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)

    def __enter__(self) -> TracebackWatch:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *_: Any) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


@contextmanager
def probed_ingest(stack, ledger: str, topics, **overrides: Any) -> Iterator[EmbeddedIngest]:
    """An ingest for probes of bad input (issue 58: a precise 4xx, and no traceback logged):
    when the test has passed, fails it if ingest logged an error or a traceback meanwhile."""
    with TracebackWatch() as watch:
        server = start_ingest(stack, ledger, topics, **overrides)
        try:
            yield server
        finally:
            server.stop()
    logged = [f"{r.name}: {r.getMessage()}" for r in watch.records]
    assert logged == [], "ingest logged an error or a traceback: " + "; ".join(logged)


def cli(dsn: str, *args: str, input: str | None = None) -> str:
    """Run a `vigil` operator command in this process against ``dsn``; its stdout."""
    from vigil.cli import main

    result = CliRunner().invoke(main, list(args), env={"VIGIL_DATABASE_URL": dsn}, input=input, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def create_token(dsn: str, name: str = "tests") -> dict:
    import json

    return json.loads(cli(dsn, "tokens", "create", name, "--json"))


def read_events(
    bootstrap: str, topic: str, expected: int, partitions: int = 4, timeout: float = 20.0, settle: float = 0.0
) -> list[Event]:
    """Every event on ``topic`` once ``expected`` have arrived (then ``settle`` seconds more,
    to catch any extra copy that should not be there)."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex}", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    codec = EventCodec()
    found: list[Event] = []
    try:
        deadline = time.monotonic() + timeout
        extra_until = None
        while time.monotonic() < deadline:
            if len(found) >= expected and extra_until is None:
                extra_until = time.monotonic() + settle
            if extra_until is not None and time.monotonic() >= extra_until:
                break
            message = consumer.poll(0.2)
            if message is None or message.error():
                continue
            found.append(codec.decode(message.value()))
    finally:
        consumer.close()
    return found


def ledger_count(dsn: str, sql: str, params: Any = None) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, params).fetchone()[0]


def make_request(dsn: str, request_id: str, due: datetime, user_id: str = USER) -> str:
    """An approval request as the worker's finish writes it; returns its answer token."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            Q.approval_create,
            {
                "request_id": request_id,
                "user_id": user_id,
                "session_id": f"s-{request_id}",
                "run_id": None,
                "tool": "refund",
                "tool_use_id": "toolu_1",
                "args_hash": approvals.args_hash("refund", {"amount": 1200}),
                "due": due,
                "on_expiry": "deny",
            },
        )
    return approvals.sign_token(secret=APPROVAL_SECRET, request_id=request_id, user_id=user_id)


def stored(dsn: str, request_id: str) -> dict:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(Q.approval_get, {"request_id": request_id}).fetchone()
