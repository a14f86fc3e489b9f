"""The kafka and log channels, and the operator commands (`vigil channels`, `vigil outbox`)."""

from __future__ import annotations

import io
import json
import uuid
from datetime import datetime

import psycopg
import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from dispatcher_support import (
    T0,
    Receiver,
    add_message,
    add_users,
    in_process_dispatcher,
    one_pass,
    standard_webhooks_valid,
)
from support import query, scalar, wait_for
from vigil.bus.codec import DELIVERY_SCHEMA_NAME, AvroCodec
from vigil.cli import main
from vigil.clock import ManualClock
from vigil.ledger import channels

SIGNATURE = "v1." + "A" * 43
QUESTION_ACTIONS = [
    {
        "id": "approve",
        "label": "Approve",
        "answer": "yes",
        "method": "POST",
        "url": f"/v1/approvals/apr-1/actions/yes?expires=1900000000&signature={SIGNATURE}",
        "request_id": "apr-1",
        "expires_at": "2030-03-17T17:46:40+00:00",
    }
]


def test_kafka_channel_writes_an_avro_delivery_keyed_by_user(ledger, stack, topics):
    d = in_process_dispatcher(
        ledger, ManualClock(T0.timestamp()), kafka_bootstrap=stack.bootstrap, deliveries_topic=topics.deliveries
    )
    try:
        add_users(ledger, ["kai"])
        runner = CliRunner()
        result = runner.invoke(main, ["channels", "set", "kai", "--type", "kafka"], env={"VIGIL_DATABASE_URL": ledger})
        assert result.exit_code == 0, result.output
        first = add_message(ledger, "kai", "first", created_at=T0)
        add_message(ledger, "kai", "second", created_at=T0)
        # Joined messages of two conversations: a reply continues the newest one's.
        with psycopg.connect(ledger) as conn:
            conn.execute("UPDATE outbox SET session_id = CASE WHEN id = %s THEN 'ses-a' ELSE 'ses-b' END", (first,))
            conn.execute("UPDATE outbox SET actions = %s WHERE id = %s", (Jsonb(QUESTION_ACTIONS), first))
        assert one_pass(d) == 1
    finally:
        d.close()
    consumer = Consumer(
        {"bootstrap.servers": stack.bootstrap, "group.id": f"t-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topics.deliveries])
    try:
        message = wait_for(lambda: _polled(consumer), 30, "the delivery on the topic")
    finally:
        consumer.close()
    record = AvroCodec(DELIVERY_SCHEMA_NAME).decode_record(message.value())
    delivery_id = scalar(ledger, "SELECT DISTINCT delivery_id::text FROM outbox")
    assert message.key() == b"kai"
    assert dict(message.headers())["delivery-id"].decode() == delivery_id
    assert (record["delivery_id"], record["user_id"], record["messages"]) == (delivery_id, "kai", ["first", "second"])
    assert record["sent_at"] == T0
    assert record["session_id"] == "ses-b"
    assert record["actions"] == QUESTION_ACTIONS  # the same structure as the webhook's data.actions
    assert query(ledger, "SELECT DISTINCT status, channel FROM outbox") == [{"status": "delivered", "channel": "kafka"}]


def _polled(consumer):
    message = consumer.poll(0.5)
    return message if message is not None and not message.error() else None


def test_a_user_without_a_channel_gets_one_json_line_on_the_log(ledger):
    out = io.StringIO()
    d = in_process_dispatcher(ledger, ManualClock(T0.timestamp()), log_stream=out)
    try:
        add_users(ledger, ["lee"])
        add_message(ledger, "lee", "hello from the agent", created_at=T0)
        with psycopg.connect(ledger) as conn:
            conn.execute("UPDATE outbox SET session_id = 'ses-l', actions = %s", (Jsonb(QUESTION_ACTIONS),))
        one_pass(d)
    finally:
        d.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    line = json.loads(lines[0])
    assert line["channel"] == "log" and line["data"]["user_id"] == "lee"
    assert line["data"]["messages"][0]["body"] == "hello from the agent"
    assert line["data"]["session_id"] == line["data"]["messages"][0]["session_id"] == "ses-l"
    assert line["data"]["delivery_id"] == scalar(ledger, "SELECT delivery_id::text FROM outbox")
    # The question's actions, their signatures redacted like the answer token: a log is read by more people.
    [approve] = line["data"]["actions"]
    assert approve["url"] == QUESTION_ACTIONS[0]["url"].replace(SIGNATURE, "v1.[redacted]")
    assert {k: v for k, v in approve.items() if k != "url"} == {
        k: v for k, v in QUESTION_ACTIONS[0].items() if k != "url"
    }


@pytest.fixture
def cli(ledger):
    runner = CliRunner()

    def run(*args: str, ok: bool = True):
        result = runner.invoke(main, list(args), env={"VIGIL_DATABASE_URL": ledger, "USER": "oncall"})
        if ok:
            assert result.exit_code == 0, result.output
        return result

    return run


def opened_secret(dsn: str, user_id: str) -> str | None:
    """A channel's secret as the dispatcher reads it (sealed in the row: tests/test_secrets.py)."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        row = channels.get(conn, user_id)
    return row.secret if row else None


def test_channels_set_prints_the_secret_once_and_show_never_does(ledger, cli):
    add_users(ledger, ["ana"])
    created = json.loads(
        cli(
            "channels", "set", "ana", "--type", "webhook", "--url", "http://127.0.0.1:1/a", "--gap", "600", "--json"
        ).output
    )
    secret = created["secret"]
    assert secret.startswith("whsec_") and created["gap_seconds"] == 600
    assert opened_secret(ledger, "ana") == secret

    # Changing the URL keeps the secret (the receiver holds it) and the gap; nothing printed.
    moved = cli("channels", "set", "ana", "--type", "webhook", "--url", "http://127.0.0.1:1/b")
    assert "whsec_" not in moved.output and "gap 600s" in moved.output
    assert opened_secret(ledger, "ana") == secret
    rotated = json.loads(
        cli(
            "channels", "set", "ana", "--type", "webhook", "--url", "http://127.0.0.1:1/b", "--rotate-secret", "--json"
        ).output
    )
    assert rotated["secret"] != secret

    shown = cli("channels", "show", "ana").output + cli("channels", "show", "ana", "--json").output
    assert "whsec_" not in shown and "http://127.0.0.1:1/b" in shown
    back = json.loads(cli("channels", "set", "ana", "--type", "log", "--gap", "default", "--json").output)
    assert (back["type"], back["url"], back["gap_seconds"]) == ("log", None, None)
    assert scalar(ledger, "SELECT secret FROM channels WHERE user_id = 'ana'") is None
    audit = query(ledger, "SELECT actor, action, detail FROM audit ORDER BY id")
    assert [a["action"] for a in audit] == ["channel.set"] * 4 and audit[0]["actor"] == "oncall"
    assert all("whsec_" not in json.dumps(a["detail"]) for a in audit)


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["--type", "webhook"], "needs --url"),
        (["--type", "webhook", "--url", "ftp://x"], "http(s) URL"),
        (["--type", "kafka", "--url", "http://x"], "only for --type webhook"),
        (["--type", "log", "--gap", "-5"], "expected a whole number from 0 to 2147483647"),
        (["--type", "log", "--gap", "3000000000"], "expected a whole number from 0 to 2147483647"),
        (["--type", "log", "--urgent-cap", "²"], "expected a whole number from 0 to 2147483647"),
        # Issue 58: the send-time policy's rules at set time (the suite allows 127.0.0.0/8 and ::1).
        (["--type", "webhook", "--url", "http://10.0.0.5/hook"], "10.0.0.5 is not a public address"),
        (["--type", "webhook", "--url", "http://169.254.169.254/"], "169.254.169.254 is not a public address"),
        (["--type", "webhook", "--url", "http://0xa9.254.169.254/"], "169.254.169.254 is not a public address"),
        (["--type", "webhook", "--url", "http://[fd00::1]:8080/"], "fd00::1 is not a public address"),
        (["--type", "webhook", "--url", "http://exa\r\nmple.com/"], "control character"),
        (["--type", "webhook", "--url", "http://exa mple.com/"], "control character"),
        (["--type", "webhook", "--url", "http://<b>x</b>.example.com/"], "characters no host name"),
    ],
)
def test_channels_set_refuses_what_cannot_work(ledger, cli, args, complaint):
    result = cli("channels", "set", "ana", *args, ok=False)
    assert result.exit_code == 2 and complaint in result.output
    assert scalar(ledger, "SELECT count(*) FROM channels") == 0


def test_outbox_lists_rows_dead_deliveries_and_revives_one_under_its_id(ledger, cli):
    receiver = Receiver(answer=lambda _r: (410, {})).start()
    clock = ManualClock(T0.timestamp())
    d = in_process_dispatcher(ledger, clock)
    try:
        add_users(ledger, ["ana"])
        secret = json.loads(cli("channels", "set", "ana", "--type", "webhook", "--url", receiver.url, "--json").output)[
            "secret"
        ]
        add_message(ledger, "ana", "will be refused", created_at=T0)
        one_pass(d)
        delivery_id = scalar(ledger, "SELECT delivery_id::text FROM outbox")
        listing = cli("outbox", "ana").output
        assert "dead" in listing and delivery_id in listing and "HTTP 410 (not retried)" in listing
        row = json.loads(cli("outbox", "ana", "--json").output.splitlines()[0])
        assert (row["status"], row["attempts"], row["delivery_id"]) == ("dead", 1, delivery_id)
        assert delivery_id in cli("outbox", "--dead").output

        receiver.answer = lambda _r: (200, {})
        cli("outbox", "--revive", delivery_id)
        clock.set(T0.replace(year=2027).timestamp())  # revival is due at once, whatever the dispatcher's clock says
        one_pass(d)
    finally:
        d.close()
        receiver.stop()
    got = receiver.got()
    assert [r.id for r in got] == [delivery_id, delivery_id]
    assert got[0].body == got[1].body and standard_webhooks_valid(secret, got[1])
    assert query(ledger, "SELECT status, attempts FROM outbox") == [{"status": "delivered", "attempts": 1}]
    assert cli("outbox", "--revive", delivery_id, ok=False).exit_code == 1, "only a dead delivery can be revived"
    assert cli("outbox", ok=False).exit_code == 2


def test_outbox_json_carries_the_session_and_the_deadline(ledger, cli):
    """`vigil outbox USER --json`: each row's conversation (``session_id``, what a reply names to
    continue it) and an approval question's ``deadline``; None where the row has none."""
    add_users(ledger, ["ana"])
    question = add_message(ledger, "ana", "Approval needed: refund A1?", created_at=T0)
    add_message(ledger, "ana", "no conversation", created_at=T0)
    with psycopg.connect(ledger) as conn:
        conn.execute(
            "UPDATE outbox SET session_id = 'ses-1', deadline = %s WHERE id = %s", (T0.replace(hour=23), question)
        )
    rows = [json.loads(line) for line in cli("outbox", "ana", "--json").output.splitlines()]
    assert [(r["body"], r["session_id"], r["deadline"]) for r in rows][0] == ("no conversation", None, None)
    assert (rows[1]["session_id"], datetime.fromisoformat(rows[1]["deadline"])) == ("ses-1", T0.replace(hour=23))
