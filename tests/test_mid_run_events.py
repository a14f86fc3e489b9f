"""Events that arrive while a run is talking to the model, on a real worker (Claude agent,
scripted Messages API, real broker and ledger).

- fold (a user's own policy, `vigil policies set`): the message is claimed under the run's
  epoch at the next model turn, and finished with the run: one run, both events done.
- interrupt (the deployment's VIGIL_EVENT_POLICIES): the draft is dropped and the run starts
  over with every event; only the restarted conversation's message is sent.
- A reply naming the session the run is talking in folds into that run (the user's fold
  policy), instead of waiting to resume the session in a second run.
- A worker SIGKILLed after a fold: every event, the folded one included, is retried exactly
  once by the next owner and lands in exactly one finished run.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import UTC, datetime

import psycopg

from ingest_support import cli
from support import query, scalar, wait_for
from vigil.envelope import Event
from vigil_dev.scripted_server import ScriptedServer
from worker_support import chat, claude_env, produce

SLOW_S = 3  # the first model call takes this long: time for a second event to arrive


def script(slow_s: float = SLOW_S, folded_delay_s: float = 0) -> dict:
    return {
        "rules": [
            {
                "when": {"user_text": "the site is down"},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Paging: the site is down."}}],
            },
            {
                "when": {"user_text": "also this"},
                "delay": folded_delay_s,
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Got the addition."}}],
            },
            {
                "when": {"user_text": "slow task"},
                "delay": slow_s,
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Working on it."}}],
            },
            {"when": {"tool_result": "send_message"}, "reply": []},
        ]
    }


def asked(server, text: str) -> bool:
    return any(text in json.dumps(r["messages"]) for r in server.requests())


def outbox(dsn: str, user: str) -> list[str]:
    return [r["body"] for r in query(dsn, "SELECT body FROM outbox WHERE user_id = %s ORDER BY id", (user,))]


def pager(user: str, text: str) -> Event:
    return Event(
        user_id=user,
        source="pager",
        source_id=uuid.uuid4().hex,
        kind="pager.alert",
        payload=json.dumps({"text": text}),
        received_at=datetime.now(UTC),
    )


def test_fold_claims_a_message_under_the_runs_epoch_and_finishes_it_with_the_run(
    spawn, vigil_env, ledger, stack, topics
):
    user = "u-fold"
    assert "chat=fold" in cli(ledger, "policies", "set", user, "chat=fold")
    with ScriptedServer(script()) as server:
        env = claude_env(vigil_env, server.base_url)  # the deployment queues: only this user folds
        spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
        produce(stack.bootstrap, topics.events, [chat(user, "a slow task")])
        wait_for(lambda: asked(server, "a slow task"), 30, "the first model call", interval=0.05)
        produce(stack.bootstrap, topics.events, [chat(user, "and also this")])
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM runs") >= 1, 60, "the run", interval=0.2)

        assert outbox(ledger, user) == ["Working on it.", "Got the addition."]
        [run] = query(ledger, "SELECT id, epoch, event_ids, outcome FROM runs")
        events = query(ledger, "SELECT id, status, attempts, claim_epoch, run_id FROM events ORDER BY id")
        assert len(events) == 2 and sorted(run["event_ids"]) == [e["id"] for e in events]
        for event in events:  # claimed under the run's epoch, finished with it
            assert (event["status"], event["attempts"], event["claim_epoch"], event["run_id"]) == (
                "done",
                1,
                run["epoch"],
                run["id"],
            )
        # The second model call saw the folded message after the first call's tool result.
        folded = next(r for r in server.requests() if "and also this" in json.dumps(r["messages"]))
        assert "a slow task" in json.dumps(folded["messages"])


def test_a_reply_naming_the_running_session_folds_into_the_run_in_progress(spawn, vigil_env, ledger, stack, topics):
    """Before: events naming a session were never folded, so the reply waited for the run to
    end and then resumed the session in a second run, after the first had already answered."""
    user = "u-fold-session"
    assert "chat=fold" in cli(ledger, "policies", "set", user, "chat=fold")
    with psycopg.connect(ledger) as conn:
        conn.execute("INSERT INTO sessions (id, user_id) VALUES ('ses-live', %s), ('ses-other', %s)", (user, user))
    with ScriptedServer(script()) as server:
        env = claude_env(vigil_env, server.base_url)
        spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
        produce(stack.bootstrap, topics.events, [replace(chat(user, "a slow task"), session_id="ses-live")])
        wait_for(lambda: asked(server, "a slow task"), 30, "the first model call", interval=0.05)
        produce(stack.bootstrap, topics.events, [replace(chat(user, "and also this"), session_id="ses-live")])
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM runs") >= 1, 60, "the run", interval=0.2)
        assert outbox(ledger, user) == ["Working on it.", "Got the addition."]
        [run] = query(ledger, "SELECT event_ids, session_id FROM runs")
        assert len(run["event_ids"]) == 2 and run["session_id"] == "ses-live"  # one run took both
        conversation = json.dumps(scalar(ledger, "SELECT messages FROM sessions WHERE id = 'ses-live'"))
        assert conversation.index("a slow task") < conversation.index("and also this")
        assert scalar(ledger, "SELECT messages FROM sessions WHERE id = 'ses-other'") == []


def test_interrupt_drops_the_draft_and_restarts_the_run_with_every_event(spawn, vigil_env, ledger, stack, topics):
    user = "u-interrupt"
    with ScriptedServer(script()) as server:
        env = claude_env(vigil_env, server.base_url, VIGIL_EVENT_POLICIES="pager=interrupt")
        spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
        produce(stack.bootstrap, topics.events, [chat(user, "a slow task")])
        wait_for(lambda: asked(server, "a slow task"), 30, "the first model call", interval=0.05)
        produce(stack.bootstrap, topics.events, [pager(user, "the site is down")])
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM runs") >= 1, 60, "the run", interval=0.2)

        assert outbox(ledger, user) == ["Paging: the site is down."]  # "Working on it." was dropped
        [run] = query(ledger, "SELECT id, event_ids FROM runs")
        assert len(run["event_ids"]) == 2
        assert scalar(ledger, "SELECT count(*) FROM events WHERE status = 'done' AND run_id = %s", (run["id"],)) == 2
        restarted = next(r for r in server.requests() if "the site is down" in json.dumps(r["messages"]))
        transcript = json.dumps(restarted["messages"])
        assert "start over" in transcript and "a slow task" in transcript
        assert "Working on it." not in transcript


def test_a_worker_killed_after_a_fold_leaves_every_event_retried_exactly_once(spawn, vigil_env, ledger, stack, topics):
    user = "u-fold-crash"
    cli(ledger, "policies", "set", user, "chat=fold")
    with ScriptedServer(script(folded_delay_s=60)) as server:
        env = claude_env(vigil_env, server.base_url)
        first = spawn(["worker"], env, name="worker-1").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
        produce(stack.bootstrap, topics.events, [chat(user, "a slow task")])
        wait_for(lambda: asked(server, "a slow task"), 30, "the first model call", interval=0.05)
        produce(stack.bootstrap, topics.events, [chat(user, "and also this")])
        # The folded message reached the model: both events are claimed under one epoch.
        wait_for(lambda: asked(server, "and also this"), 30, "the call after the fold", interval=0.05)
        claimed = query(ledger, "SELECT status, attempts, claim_epoch FROM events ORDER BY id")
        assert [(e["status"], e["attempts"]) for e in claimed] == [("running", 1), ("running", 1)]
        assert claimed[0]["claim_epoch"] == claimed[1]["claim_epoch"]
        first.kill()

        server.set_script(script(slow_s=0))
        spawn(["worker"], env, name="worker-2").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
        wait_for(
            lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status = 'done'") == 2,
            90,
            "both events done after the takeover",
            interval=0.2,
        )
        events = query(ledger, "SELECT id, attempts, lost_claims FROM events ORDER BY id")
        assert [(e["attempts"], e["lost_claims"]) for e in events] == [(2, 1), (2, 1)]
        runs = query(ledger, "SELECT event_ids FROM runs WHERE outcome <> 'failed'")
        finished = [i for r in runs for i in r["event_ids"]]
        assert sorted(finished) == [e["id"] for e in events], "each event in exactly one finished run"
        assert scalar(ledger, "SELECT count(*) FROM runs WHERE outcome = 'failed'") == 0
