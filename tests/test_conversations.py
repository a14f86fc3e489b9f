"""Conversations that continue, on real processes: ingest, a worker running the Claude agent
against the scripted Messages API, and the dispatcher delivering to a webhook receiver.

- A reply naming the delivery it answers (``in_reply_to``) resumes the session that wrote
  it: the model's request for the reply carries the first run's transcript. A message that
  names nothing starts a new session, as before.
- Auto mode's block counters live with the session, so they add up across wake-ups: the
  fourth risky call in a row, three runs later, asks the person instead of being blocked.
- Past messages: the worker loads ``VIGIL_RECENT_MESSAGES`` of them (not a fixed 20), and
  those the outbox still holds back for the pacing gap are among them, marked queued.
- Task progress: one run writes ``/memories/tasks/<name>.md``; after a worker restart the
  next run finds it first in the memory index and continues from it.
- An event that died is told to the agent once, at the user's next run.
- A follow-up timer resumes the conversation that set it.
- Answers where the person is: the approval question's delivery carries approve / deny
  actions, and a "yes" replying to it answers the approval (the refund runs once); the
  action URL used afterwards is refused.
"""

from __future__ import annotations

import json

import httpx
import psycopg
import pytest

from dispatcher_support import Receiver, add_messages
from ingest_support import cli, create_token
from support import query, scalar, wait_for
from vigil_dev.scripted_server import ScriptedServer
from worker_support import chat, claude_env, produce

# User-text rules first: a message that resumes a session is appended to the turn that holds
# the previous run's last tool result, and must be answered, not taken for that result.
SCRIPT = {
    "rules": [
        {"when": {"user_text": "poison pill"}, "error": {"status": 400, "message": "cannot be processed"}},
        {
            "when": {"user_text": "start the invoice migration"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "memory",
                    "input": {
                        "command": "create",
                        "path": "/memories/tasks/invoices.md",
                        "file_text": "# Migrate the invoices\nDone: batch 1 of 3.\nNext: batch 2 of 3.\n",
                    },
                }
            ],
        },
        {
            "when": {"user_text": "carry on with the migration"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "memory",
                    "input": {"command": "view", "path": "/memories/tasks/invoices.md"},
                }
            ],
        },
        {
            "when": {"tool_result": "memory", "tool_result_text": r"Next: (?P<next>[^\n]+)"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Continuing with {next}"}}],
        },
        {"when": {"tool_result": "memory"}, "reply": []},
        {
            "when": {"user_text": "what did I ask you to keep"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Still on it."}}],
        },
        {
            "when": {"user_text": r"keep (?P<word>[a-z]+) in mind"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Noted {word}."}}],
        },
        {
            "when": {"user_text": r"refund (?P<order>\w+) in full"},
            "reply": [{"type": "tool_use", "name": "refund", "input": {"order_id": "{order}", "amount": 500}}],
        },
        {
            "when": {"tool_result": "refund", "tool_result_error": True},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "I may not do that alone."}}],
        },
        {
            "when": {"tool_result": "refund", "tool_result_text": "(?i)refund"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Refund done."}}],
        },
        {
            "when": {"user_text": r"remind me about (?P<what>[a-z]+) in a moment"},
            "reply": [
                {"type": "tool_use", "name": "set_followup", "input": {"delay_seconds": 1, "note": "ask about {what}"}}
            ],
        },
        {
            "when": {"user_text": r"timer\.followup"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Following up, as you asked."}}],
        },
        {"when": {"tool_result": "set_followup"}, "reply": []},
        {"when": {"tool_result": "send_message"}, "reply": []},
    ]
}


@pytest.fixture
def claude():
    with ScriptedServer(SCRIPT) as server:
        yield server


@pytest.fixture
def receiver():
    receiver = Receiver().start()
    yield receiver
    receiver.stop()


class Stack:
    """ingest + worker (Claude, scripted) + dispatcher, one user's webhook channel without a gap."""

    def __init__(self, spawn, vigil_env, ledger, claude, receiver, user, **worker_extra):
        self.user, self.ledger, self.receiver = user, ledger, receiver
        cli(ledger, "channels", "set", user, "--type", "webhook", "--url", receiver.url, "--gap", "0")
        self.token = create_token(ledger)["token"]
        ports = {name: int(vigil_env[f"VIGIL_{name.upper()}_PORT"]) for name in ("worker", "ingest", "dispatcher")}
        worker_env = claude_env(vigil_env, claude.base_url, **worker_extra)
        spawn(["worker"], worker_env, name="worker").wait_healthy(ports["worker"])
        spawn(["ingest"], vigil_env, name="ingest").wait_healthy(ports["ingest"])
        env = {**vigil_env, "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.1"}
        spawn(["dispatcher"], env, name="dispatcher").wait_healthy(ports["dispatcher"])
        self.url = f"http://127.0.0.1:{ports['ingest']}/v1/users/{user}/messages"

    def say(self, body: dict) -> httpx.Response:
        return httpx.post(self.url, json=body, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def delivery(self, n: int) -> dict:
        """The n-th delivery's data (1-based), once it arrived."""
        wait_for(lambda: len(self.receiver.got()) >= n, 90, f"delivery {n} at the receiver", interval=0.2)
        return self.receiver.got()[n - 1].data


def transcript_text(request: dict) -> str:
    return json.dumps(request["messages"], ensure_ascii=False)


def test_reply_to_a_delivery_resumes_its_session(spawn, vigil_env, ledger, claude, receiver):
    stack = Stack(spawn, vigil_env, ledger, claude, receiver, "u-conv")
    assert stack.say({"text": "please keep pineapple in mind"}).status_code == 202
    first = stack.delivery(1)
    assert [m["body"] for m in first["messages"]] == ["Noted pineapple."]
    session = first["session_id"]
    assert session and first["messages"][0]["session_id"] == session
    assert scalar(ledger, "SELECT session_id FROM runs") == session

    # Refused precisely, nothing produced: a delivery this user never got, or both names at once.
    unknown = stack.say({"text": "x", "in_reply_to": "00000000-0000-4000-8000-000000000000"})
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_delivery", unknown.text
    both = stack.say({"text": "x", "in_reply_to": first["delivery_id"], "session_id": session})
    assert both.status_code == 400 and both.json()["field"] == "in_reply_to", both.text

    reply = stack.say({"text": "what did I ask you to keep?", "in_reply_to": first["delivery_id"]})
    assert reply.status_code == 202 and reply.json()["session_id"] == session, reply.text
    second = stack.delivery(2)
    assert [m["body"] for m in second["messages"]] == ["Still on it."]
    assert second["session_id"] == session

    # The model's request for the reply carried the first run's conversation.
    asked = next(r for r in claude.requests() if "what did I ask you to keep" in transcript_text(r))
    assert "please keep pineapple in mind" in transcript_text(asked)
    assert "Noted pineapple." in transcript_text(asked)
    runs = query(ledger, "SELECT session_id FROM runs ORDER BY id")
    assert [r["session_id"] for r in runs] == [session, session]

    # A message naming nothing starts a new conversation, as before.
    assert stack.say({"text": "what did I ask you to keep now"}).status_code == 202
    third = stack.delivery(3)
    assert third["session_id"] not in (None, session)
    fresh = [r for r in claude.requests() if "what did I ask you to keep now" in transcript_text(r)][0]
    assert "pineapple" not in transcript_text(fresh)


def test_auto_mode_blocks_add_up_across_wake_ups_then_the_question_escalates_until_denied(
    spawn, vigil_env, ledger, claude, receiver
):
    stack = Stack(
        spawn,
        vigil_env,
        ledger,
        claude,
        receiver,
        "u-auto",
        VIGIL_TOOL_PERMISSIONS="refund=auto",  # refunds above VIGIL_REFUND_AUTO_LIMIT (50) are risky
        VIGIL_APPROVAL_ON_EXPIRY="escalate",
        VIGIL_APPROVAL_DEADLINE_S="3",
    )
    assert stack.say({"text": "refund A1 in full"}).status_code == 202
    previous = stack.delivery(1)
    session = previous["session_id"]
    for n, expected in ((2, 2), (3, 3)):
        assert scalar(ledger, "SELECT consecutive_blocks FROM sessions WHERE id = %s", (session,)) == expected - 1
        body = {"text": f"refund A{n} in full", "in_reply_to": previous["delivery_id"]}
        assert stack.say(body).json()["session_id"] == session
        previous = stack.delivery(n)
        assert [m["body"] for m in previous["messages"]] == ["I may not do that alone."]
    row = query(ledger, "SELECT blocks, consecutive_blocks, state FROM sessions WHERE id = %s", (session,))[0]
    assert (row["blocks"], row["consecutive_blocks"], row["state"]) == (3, 3, "open")

    # Three blocks in a row, over three wake-ups: the fourth call asks the person instead.
    assert stack.say({"text": "refund A4 in full", "in_reply_to": previous["delivery_id"]}).status_code == 202
    question = stack.delivery(4)
    assert question["messages"][0]["body"].startswith("Approval needed: refund")
    assert question["session_id"] == session
    assert scalar(ledger, "SELECT state FROM sessions WHERE id = %s", (session,)) == "waiting"
    assert scalar(ledger, "SELECT deadline IS NOT NULL FROM outbox ORDER BY id DESC LIMIT 1")
    assert scalar(ledger, "SELECT count(*) FROM sessions WHERE user_id = 'u-auto'") == 1

    # Nobody answers: with `escalate` the question comes again at every deadline, and the
    # tool never runs on silence, until an operator denies it.
    env = {**vigil_env, "VIGIL_SCHEDULER_TICK_S": "0.2", "VIGIL_SCHEDULER_ESCALATE_AFTER_S": "3"}
    spawn(["scheduler"], env, name="scheduler").wait_healthy(int(vigil_env["VIGIL_SCHEDULER_PORT"]))

    def bodies() -> list[str]:
        return [m["body"] for r in receiver.got() for m in r.data["messages"]]

    wait_for(lambda: sum(b.startswith("STILL WAITING") for b in bodies()) >= 2, 60, "two escalations", interval=0.2)
    [request_id] = [r["request_id"] for r in query(ledger, "SELECT request_id FROM approvals")]
    listed = json.loads(cli(ledger, "approvals", "list", "--user", "u-auto", "--json"))
    assert listed["request_id"] == request_id and listed["answer"] is None and listed["escalations"] >= 2
    assert "denied" in cli(ledger, "approvals", "deny", request_id)
    wait_for(lambda: bodies()[-1] == "I may not do that alone.", 60, "the reply to the denial", interval=0.2)
    assert scalar(ledger, "SELECT answer FROM approvals") == "no"
    assert scalar(ledger, "SELECT state FROM sessions WHERE id = %s", (session,)) == "open"
    assert scalar(ledger, "SELECT count(*) FROM refunds") == 0
    denial = [r for r in claude.requests() if "the person denied this request" in transcript_text(r)]
    assert denial and "refund A1 in full" in transcript_text(denial[0])


def test_a_yes_replying_to_the_question_answers_it_where_the_person_is(spawn, vigil_env, ledger, claude, receiver):
    """Before: the question said to POST /v1/approvals with a token, and a "yes" sent as a
    reply to it started a new conversation; the refund never ran."""
    ingest_url = f"http://127.0.0.1:{vigil_env['VIGIL_INGEST_PORT']}"
    conv = Stack(
        spawn,
        vigil_env,
        ledger,
        claude,
        receiver,
        "u-answers",
        VIGIL_TOOL_PERMISSIONS="refund=ask",
        VIGIL_APPROVAL_ACTIONS_BASE_URL=ingest_url,
    )
    assert conv.say({"text": "refund B7 in full"}).status_code == 202
    question = conv.delivery(1)
    assert question["messages"][0]["body"].startswith("Approval needed: refund")
    [request_id] = [r["request_id"] for r in query(ledger, "SELECT request_id FROM approvals")]
    actions = {a["id"]: a for a in question["actions"]}
    assert set(actions) == {"approve", "deny"} and actions["approve"]["request_id"] == request_id
    assert actions["approve"]["url"].startswith(f"{ingest_url}/v1/approvals/{request_id}/actions/yes?")
    assert actions["deny"]["expires_at"] == scalar(ledger, "SELECT due FROM approvals").isoformat()

    reply = conv.say({"text": "Yes!", "in_reply_to": question["delivery_id"]})
    assert reply.status_code == 202, reply.text
    assert (reply.json()["answer"], reply.json()["session_id"]) == ("yes", question["session_id"])
    done = conv.delivery(2)
    assert [m["body"] for m in done["messages"]] == ["Refund done."] and done["session_id"] == question["session_id"]
    assert scalar(ledger, "SELECT answered_via FROM approvals") == "chat"
    assert scalar(ledger, "SELECT count(*) FROM refunds") == 1
    assert scalar(ledger, "SELECT count(*) FROM sessions WHERE user_id = 'u-answers'") == 1  # no new conversation
    late_tap = httpx.post(actions["deny"]["url"], timeout=30)
    assert late_tap.status_code == 409 and late_tap.json()["error"] == "already_answered", late_tap.text


def test_a_follow_up_resumes_the_conversation_that_set_it(spawn, vigil_env, ledger, claude, receiver):
    """Before: the timer's event named no session, so the follow-up started a conversation
    that had never heard of the request."""
    conv = Stack(spawn, vigil_env, ledger, claude, receiver, "u-followup")
    env = {**vigil_env, "VIGIL_SCHEDULER_TICK_S": "0.2"}
    spawn(["scheduler"], env, name="scheduler").wait_healthy(int(vigil_env["VIGIL_SCHEDULER_PORT"]))
    assert conv.say({"text": "remind me about tea in a moment"}).status_code == 202
    followed = conv.delivery(1)
    assert [m["body"] for m in followed["messages"]] == ["Following up, as you asked."]
    [session] = [r["id"] for r in query(ledger, "SELECT id FROM sessions WHERE user_id = 'u-followup'")]
    assert followed["session_id"] == session  # one conversation, resumed by the timer
    asked_again = next(r for r in claude.requests() if "timer.followup" in transcript_text(r))
    assert "remind me about tea in a moment" in transcript_text(asked_again)  # with its transcript
    assert json.loads(scalar(ledger, "SELECT payload::text FROM timers"))["session_id"] == session


def test_past_messages_show_what_the_outbox_still_holds(spawn, vigil_env, ledger, claude, stack, topics):
    user = "u-past"
    ids = add_messages(ledger, [(user, f"old news {n}", False) for n in range(25)] + [(user, "held back", False)])
    with psycopg.connect(ledger) as conn:  # 25 delivered, the last one still held for the gap
        conn.execute("UPDATE outbox SET status = 'delivered', delivered_at = now() WHERE id = ANY(%s)", (ids[:-1],))
    env = claude_env(vigil_env, claude.base_url, VIGIL_RECENT_MESSAGES="30")
    spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
    produce(stack.bootstrap, topics.events, [chat(user, "please keep mango in mind")])
    wait_for(lambda: scalar(ledger, "SELECT count(*) FROM runs WHERE worker <> %s", ("test",)) == 1, 60, "the run")

    [asked] = [r for r in claude.requests() if "mango" in transcript_text(r)][:1]
    volatile = asked["system"][2]["text"]
    delivered, queued = volatile.split("queued and not delivered yet")
    assert all(f'"old news {n}"' in delivered for n in range(25)), "all 25 delivered, past the old fixed 20"
    assert '"held back"' in queued and '"held back"' not in delivered


def agent_runs(dsn: str, user: str) -> int:
    return scalar(dsn, "SELECT count(*) FROM runs WHERE user_id = %s", (user,))


def test_task_progress_written_by_one_run_is_read_after_a_worker_restart(
    spawn, vigil_env, ledger, claude, stack, topics
):
    user = "u-task"
    env = claude_env(vigil_env, claude.base_url)
    port = int(env["VIGIL_WORKER_PORT"])
    first = spawn(["worker"], env, name="worker-1").wait_healthy(port)
    produce(stack.bootstrap, topics.events, [chat(user, "please start the invoice migration")])
    wait_for(lambda: agent_runs(ledger, user) == 1, 60, "the first run", interval=0.2)
    assert scalar(ledger, "SELECT content FROM memory WHERE path = '/memories/tasks/invoices.md'").startswith(
        "# Migrate the invoices"
    )
    first.stop()

    spawn(["worker"], env, name="worker-2").wait_healthy(port)
    produce(stack.bootstrap, topics.events, [chat(user, "carry on with the migration")])
    wait_for(lambda: agent_runs(ledger, user) == 2, 60, "the second run", interval=0.2)
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox WHERE user_id = %s", (user,))] == [
        "Continuing with batch 2 of 3."
    ]
    carried = next(r for r in claude.requests() if "carry on with the migration" in transcript_text(r))
    index = carried["system"][1]["text"].split("# Memory index", 1)[1]
    first_entry = index.strip().splitlines()[1]
    assert first_entry == "- task in progress: /memories/tasks/invoices.md -- Migrate the invoices"


def test_a_dead_event_is_told_to_the_agent_once(spawn, vigil_env, ledger, claude, stack, topics):
    user = "u-dead"
    env = claude_env(vigil_env, claude.base_url, VIGIL_MAX_ATTEMPTS="2")
    spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
    produce(stack.bootstrap, topics.events, [chat(user, "a poison pill")])
    wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status = 'dead'") == 1, 60, "the dead event")

    def volatile_of(text: str) -> str:
        asked = [r for r in claude.requests() if text in transcript_text(r)]
        return asked[0]["system"][2]["text"]

    for n, text in enumerate(("keep kiwi in mind", "keep lime in mind"), 1):
        produce(stack.bootstrap, topics.events, [chat(user, text)])
        wait_for(lambda n=n: scalar(ledger, "SELECT count(*) FROM runs WHERE outcome = 'message'") == n, 60, text)
    told, later = volatile_of("keep kiwi in mind"), volatile_of("keep lime in mind")
    assert "failed every attempt" in told and '"kind": "chat.message"' in told and '"attempts": 2' in told
    assert "failed every attempt" not in later
