"""``vigil-dev demo``: show the running stack working, step by step, against real services.

Each step prints what it did and what came back; a step that cannot pass says why and the
command exits non-zero, so ``make up`` ends in a visible failure rather than a silent one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime

import click
from confluent_kafka import Consumer, TopicPartition

from vigil.bus.codec import EventCodec
from vigil.bus.kafka import EventProducer
from vigil.envelope import Event
from vigil.ledger.db import connect
from vigil.service import load_or_exit
from vigil.settings import CommonSettings
from vigil_dev.queries import Q


class DemoFailed(click.ClickException):
    pass


# The agent's steps, in the order the demo runs them (`vigil-dev demo --step NAME` runs some).
STEPS = ("mcp", "reminder", "refund", "background", "expiry", "reply")
MCP_TOOL = "shop__order_status"  # vigil_dev/mcp_demo_server.py's tool, as the model is offered it


def _tool_exchange(messages: list[dict], name: str) -> tuple[dict | None, str | None]:
    """The input of the conversation's last call of tool ``name``, and the text of its result."""
    call_id, call, result = None, None, None
    for message in messages:
        for block in message.get("content") if isinstance(message.get("content"), list) else []:
            if block.get("type") == "tool_use" and block.get("name") == name:
                call_id, call, result = block.get("id"), block.get("input"), None
            elif block.get("type") == "tool_result" and call_id and block.get("tool_use_id") == call_id:
                content = block.get("content")
                texts = [b.get("text", "") for b in content] if isinstance(content, list) else [str(content)]
                result = "".join(texts)
    return call, result


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")


def step_broker_round_trip(settings: CommonSettings, event: Event) -> None:
    """An event produced to the events topic and read back from the partition it landed on."""
    producer = EventProducer(settings)
    try:
        [where] = producer.send([event])
    finally:
        producer.close()
    click.echo(
        f"  produced {event.kind} for {event.user_id} -> {where.topic}[{where.partition}]"
        f" offset {where.offset} (acks=all)"
    )
    consumer = Consumer(
        {
            **settings.kafka_client_options(),
            "group.id": f"vigil-demo-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(where.topic, where.partition, where.offset)])
        message = _wait(lambda: _poll_ok(consumer), 20, "the event to be read back")
        decoded = EventCodec(settings.schema_registry_url).decode(message.value())
        assert decoded.source_id == event.source_id
        click.echo(f"  read back from the broker: key={message.key().decode()} payload={decoded.payload}")
    finally:
        consumer.close()


def _poll_ok(consumer):
    message = consumer.poll(0.5)
    return message if message is not None and not message.error() else None


def step_recorded_and_answered(settings: CommonSettings, event: Event) -> str:
    with connect(settings.dsn, autocommit=True) as conn:
        row = _wait(
            lambda: conn.execute(
                Q.demo_event_by_key, {"user_id": event.user_id, "source": event.source, "source_id": event.source_id}
            ).fetchone(),
            30,
            "the worker to record the event",
        )
        click.echo(f"  recorded in the ledger as event {row['id']} ({row['status']})")
        done = _wait(
            lambda: conn.execute(Q.demo_event_done, {"id": row["id"]}).fetchone(),
            30,
            "the run to finish",
        )
        reply = conn.execute(Q.demo_run_reply, {"run_id": done["run_id"]}).fetchone()
        click.echo(
            f"  run {done['run_id']} finished; outbox row {reply['id'] if reply else '-'}:"
            f" {reply['body'] if reply else '(nothing to say)'!r}"
        )
        if reply is None:
            return ""
        delivered = _wait(
            lambda: conn.execute(Q.demo_outbox_delivered, {"id": reply["id"]}).fetchone(),
            30,
            "the dispatcher to deliver the reply",
        )
        click.echo(f"  delivered by the dispatcher (delivery id {delivered['delivery_id']})")
        return reply["body"]


class AgentDemo:
    """The agent's three endings and its timers, driven through the HTTP API like a client would."""

    def __init__(self, settings: CommonSettings, user: str):
        import httpx

        self.settings, self.user, self.seen = settings, user, 0
        self.last_delivery: dict = {}
        port = os.environ.get("VIGIL_INGEST_PORT", "8080")
        token = os.environ.get("VIGIL_API_TOKEN")
        if not token:
            raise DemoFailed("VIGIL_API_TOKEN is not set: `. .run/env` after `make up`")
        with connect(settings.dsn, autocommit=True) as conn:  # what earlier steps delivered is not news
            earlier = conn.execute(Q.demo_delivered_after, {"user_id": user, "after": 0}).fetchall()
        self.seen = earlier[-1]["id"] if earlier else 0
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    def say(self, text: str, in_reply_to: str | None = None) -> dict:
        body = {"text": text, **({"in_reply_to": in_reply_to} if in_reply_to else {})}
        response = self.http.post(
            f"/v1/users/{self.user}/messages", json=body, headers={"Idempotency-Key": uuid.uuid4().hex}
        )
        if response.status_code != 202:
            raise DemoFailed(f"POST /v1/users/{self.user}/messages answered {response.status_code}: {response.text}")
        reply = f", in_reply_to {in_reply_to} -> session {response.json().get('session_id')}" if in_reply_to else ""
        click.echo(f"  you: {text!r}  (POST /v1/users/{self.user}/messages{reply} -> 202)")
        return response.json()

    def expect(self, pattern: str, timeout: float, what: str) -> re.Match:
        with connect(self.settings.dsn, autocommit=True) as conn:

            def delivered():
                for row in conn.execute(Q.demo_delivered_after, {"user_id": self.user, "after": self.seen}).fetchall():
                    self.seen = row["id"]
                    click.echo("  agent: " + row["body"].replace("\n", "\n         "))
                    self.last_delivery = row
                    match = re.search(pattern, row["body"])
                    if match:
                        return match
                return None

            return _wait(delivered, timeout, what)

    def run(self, steps: tuple[str, ...] = STEPS) -> None:
        for step in steps:
            getattr(self, step)()

    def mcp(self) -> None:
        """The model calls a tool of an MCP server (the stack's ``shop``, VIGIL_MCP_SERVERS); its
        answer reaches the user, and the ledger's copy of the conversation holds the call."""
        click.echo("3. a tool from an MCP server: the agent asks the stack's `shop` server where an order is")
        self.say("where is order 42?")
        self.expect(r"MCP server shop\): order 42: ", 60, "the MCP tool's answer")
        session_id = self.last_delivery["session_id"]
        with connect(self.settings.dsn, autocommit=True) as conn:
            row = conn.execute(Q.demo_session_messages, {"id": session_id}).fetchone()
        call, result = _tool_exchange(row["messages"] if row else [], MCP_TOOL)
        if call is None or result is None:
            raise DemoFailed(f"session {session_id} holds no {MCP_TOOL} call and result")
        click.echo(f"  (ledger: session {session_id} holds the call {MCP_TOOL}({json.dumps(call)}) -> {result!r})")

    def reminder(self) -> None:
        click.echo("4. a follow-up: the agent sets a timer, the scheduler fires it, the agent wakes again")
        self.say("remind me in 5 seconds to stretch")
        self.expect(r"(?i)reminder", 60, "the reminder")

    def refund(self) -> None:
        click.echo("5. a deferred tool call, approved by a chat reply to the question")
        self.say("please refund order 42")
        self.expect(r"request_id: (\S+)", 60, "the approval question")
        question = self.last_delivery
        answered = self.say("yes", in_reply_to=str(question["delivery_id"]))
        if answered.get("answer") != "yes":
            raise DemoFailed(f"the reply did not answer the approval: {answered}")
        click.echo(f"  (the reply answered approval {answered['request_id']}: {answered['answer']})")
        self.expect(r"(?i)refund was made", 60, "the refund to be made")

    def background(self) -> None:
        click.echo("6. background work: the agent delegates research to a sub-agent and reports when it is back")
        self.say("please research the printing press in the background")
        self.expect(r"(?i)started that research", 60, "the agent to start a background task")
        self.expect(r"(?i)research is back", 90, "the background task's result")

    def expiry(self) -> None:
        click.echo("7. a deferred tool call nobody answers: it expires into a denial")
        self.say("please refund order 43")
        self.expect(r"request_id: (\S+)", 60, "the approval question")
        deadline = os.environ.get("VIGIL_APPROVAL_DEADLINE_S", "?")
        click.echo(f"  (not answering; the deadline is {deadline}s away)")
        self.expect(r"(?i)not made", 180, "the expiry to deny the refund")

    def reply(self) -> None:
        click.echo("8. a reply resumes its conversation (in_reply_to: the delivery it answers)")
        self.say("my favourite colour is teal")
        self.expect(r"teal", 60, "the agent's answer")
        delivery = self.last_delivery
        click.echo(f"  (delivery {delivery['delivery_id']}, conversation {delivery['session_id']})")
        resumed = self.say("what did I just tell you?", in_reply_to=str(delivery["delivery_id"]))
        if resumed.get("session_id") != delivery["session_id"]:
            raise DemoFailed(f"the reply did not name the delivery's conversation: {resumed}")
        self.expect(r"favourite colour is teal", 60, "the agent to recall its conversation")
        self.say("what did I just tell you?")
        self.expect(r"new conversation", 60, "a message naming nothing to start a new conversation")


@click.command()
@click.option(
    "--step",
    "steps",
    multiple=True,
    type=click.Choice(STEPS),
    help="Run only these of the agent's steps (after the first two); repeatable. Default: all.",
)
def demo(steps: tuple[str, ...]) -> None:
    """Show the running stack at work: an event in, recorded, answered, delivered."""
    settings = load_or_exit(CommonSettings)
    # A fresh user per run: the outbox pacing gap (an hour by default) would hold a second
    # demo's reply for the same user.
    user = f"demo-{uuid.uuid4().hex[:6]}"
    event = Event(
        user_id=user,
        source="chat",
        source_id=f"demo-{uuid.uuid4().hex[:12]}",
        kind="chat.message",
        payload=json.dumps({"text": "hello vigil"}),
        received_at=datetime.now(UTC),
    )
    click.echo("1. an event through the real broker")
    step_broker_round_trip(settings, event)
    # The demo user's messages go out at once: the default pacing gap is an hour.
    subprocess.run(
        [sys.executable, "-m", "vigil", "channels", "set", user, "--type", "log", "--gap", "0"],
        check=True,
        capture_output=True,
    )
    click.echo("2. recorded by a worker, answered by the agent, delivered on the user's channel")
    step_recorded_and_answered(settings, event)
    if os.environ.get("VIGIL_AGENT", "claude") == "claude":
        AgentDemo(settings, user).run(steps or STEPS)
    click.echo("demo: ok")
