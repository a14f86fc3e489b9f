"""Durable runs: a worker killed at each step boundary of a run, and a frozen one that wakes up
after another has replayed its run (docs/worker.md, "Durable runs").

The run: a chat message makes the model POST to a receiver on 127.0.0.1 (``http_request``,
allowed), then send a message, then stop. Worker A is SIGKILLed at one boundary, worker B
takes the partition over and replays. For every boundary: the receiver sees one distinct
``Idempotency-Key`` for the one logical call, the model is asked each question once (the
question in flight when A died at most twice), and the run's effects commit once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

import psycopg
import pytest

from dispatcher_support import metric as scraped
from support import LocalHTTPServer, query, scalar, wait_for
from vigil_dev.devstack import free_port
from vigil_dev.scripted_server import ScriptedServer
from worker_support import assert_runs_consistent, chat, claude_env, metric, produce


class Receiver:
    """A system the agent acts on: records each POST's idempotency key; can hold its answer."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.calls: list[tuple[str, str]] = []  # (path, key) of each POST, in order
        self.hold = threading.Event()
        self.hold.set()  # answers at once unless cleared
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                receiver.keys.append(self.headers.get("Idempotency-Key") or "")
                receiver.calls.append((self.path, receiver.keys[-1]))
                receiver.hold.wait(60)
                data = b'{"refund": "made"}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = LocalHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()


def script(url: str, second_delay: float = 0.0) -> dict:
    """q1: the events -> POST; q2: the POST's result -> a message; q3: the message's -> done."""
    second = {
        "when": {"tool_result": "http_request"},
        "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Refund posted."}}],
    }
    rules = [{"when": {"tool_result": "send_message"}, "reply": []}]
    if second_delay:
        rules.append({**second, "times": 1, "delay": second_delay})
    rules += [
        second,
        {
            "when": {"user_text": "refund (?P<order>\\w+)"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "http_request",
                    "input": {"method": "POST", "url": f"{url}/refunds", "body": '{{"order": "{order}"}}'},
                }
            ],
        },
    ]
    return {"rules": rules}


def questions_in(bodies: list[dict]) -> str:
    """Which of the run's three questions the last of ``bodies`` is."""
    body = bodies[-1]
    last = body["messages"][-1]["content"]
    kinds = {block.get("type") for block in last if isinstance(block, dict)}
    if "tool_result" not in kinds:
        return "q1"
    before = body["messages"][-2]["content"]
    names = {b.get("name") for b in before if isinstance(b, dict) and b.get("type") == "tool_use"}
    return "q2" if "http_request" in names else "q3"


def questions(server: ScriptedServer) -> dict[str, int]:
    """How often the model was asked each of the run's three questions."""
    asked = {"q1": 0, "q2": 0, "q3": 0}
    for body in server.requests():
        asked[questions_in([body])] += 1
    return asked


def worker(spawn, vigil_env, server, receiver, name, **extra):
    env = claude_env(
        vigil_env,
        server.base_url,
        **{
            "VIGIL_INSTANCE_ID": name,
            "VIGIL_TOOL_PERMISSIONS": "http_request=allow",
            "VIGIL_HTTP_ALLOWED_HOSTS": receiver.url.removeprefix("http://"),
            "VIGIL_MODEL_TIMEOUT_S": "120",
            **extra,
        },
    )
    proc = spawn(["worker"], env, name)
    return proc.wait_healthy(int(env["VIGIL_WORKER_PORT"])), int(env["VIGIL_WORKER_PORT"])


def backend_waiting(dsn: str, statement: str) -> int | None:
    """The pid of a backend whose statement holding ``statement`` waits for a lock (a long
    statement's text is cut at track_activity_query_size: "" matches any)."""
    rows = query(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        " AND position(%s in query) > 0",
        (statement,),
    )
    return rows[0]["pid"] if rows else None


class Locked:
    """A table locked against writes from the test's own transaction, until released."""

    def __init__(self, dsn: str, table: str) -> None:
        self.conn = psycopg.connect(dsn)
        self.conn.execute(f"LOCK TABLE {table} IN EXCLUSIVE MODE")

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


BOUNDARIES = ["model_answered", "model_appended", "call_in_doubt", "finishing"]


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_a_worker_killed_at_a_step_boundary_repeats_nothing(boundary, stack, topics, ledger, vigil_env, spawn):
    receiver = Receiver()
    delay = 60.0 if boundary == "model_appended" else 0.0
    with ScriptedServer(script(receiver.url, delay)) as server:
        a, _ = worker(spawn, vigil_env, server, receiver, "worker-a")
        locked = None
        if boundary == "model_answered":
            locked = Locked(ledger, "run_journal")  # the first answer's append waits
        elif boundary == "finishing":
            locked = Locked(ledger, "outbox")  # the finish waits inside its transaction
        elif boundary == "call_in_doubt":
            receiver.hold.clear()  # the POST is made; its answer (the outcome) never comes back
        produce(stack.bootstrap, topics.events, [chat("ann", "refund A100")])

        if boundary == "model_answered":
            blocked = wait_for(lambda: backend_waiting(ledger, "INSERT INTO run_journal"), 30, "the append to wait")
        elif boundary == "finishing":
            blocked = wait_for(lambda: backend_waiting(ledger, ""), 30, "the finish to wait")
        elif boundary == "model_appended":
            wait_for(lambda: questions(server)["q2"] == 1, 30, "the second question to be asked")
            wait_for(lambda: scalar(ledger, "SELECT count(*) FROM run_journal WHERE outcome IS NOT NULL"), 10)
        else:
            wait_for(lambda: receiver.keys, 30, "the POST")
        a.kill()
        if locked is not None:
            # The dead worker's statement must not land once the lock is gone: its backend
            # goes with it, as a connection of a killed process does.
            query(ledger, "SELECT pg_terminate_backend(%s)", (blocked,))
            locked.release()
        receiver.hold.set()
        journaled = scalar(ledger, "SELECT count(*) FROM run_journal")

        b, b_port = worker(spawn, vigil_env, server, receiver, "worker-b")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "the run to finish on B")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status <> 'done'") == 0, 30)
        asked = questions(server)
        bodies = server.requests()

    receiver.close()
    keys = receiver.keys
    # One logical call, one key, whatever the boundary; it is made again only when in doubt.
    assert len(set(keys)) == 1, keys
    assert len(keys) == (2 if boundary == "call_in_doubt" else 1), keys
    expected = {"q1": 1, "q2": 1, "q3": 1}
    if boundary == "model_answered":
        expected["q1"] = 2  # the answer never reached the journal: asked again (at most twice)
    if boundary == "model_appended":
        expected["q2"] = 2  # in flight when A died
    assert asked == expected, (boundary, asked)
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox")] == ["Refund posted."]
    assert_runs_consistent(ledger)
    assert scalar(ledger, "SELECT count(*) FROM run_journal") == 0, "the finish ends the journal"
    replays = metric(b_port, "vigil_run_replays_total", 'reason="replayed"')
    assert replays == (1 if journaled else 0), (journaled, replays)
    if boundary in ("model_appended", "call_in_doubt", "finishing"):
        assert metric(b_port, "vigil_replay_saved_tokens_total") > 0
    if boundary == "call_in_doubt":
        assert metric(b_port, "vigil_replayed_steps_total", 'kind="in_doubt"') == 1
    if boundary == "model_appended":
        # The question asked again after the replay is the same bytes as before the crash: the
        # journaled start's system prompt and the journaled turns (the prompt cache matches).
        first, again = [b for b in bodies if questions_in([b]) == "q2"]
        assert json.dumps(first["system"]) == json.dumps(again["system"])
        assert json.dumps(first["messages"]) == json.dumps(again["messages"])
    b.stop()


def test_a_frozen_worker_lands_nothing_after_another_replayed_its_run(stack, topics, ledger, vigil_env, spawn):
    """A is SIGSTOPped while it waits for the model's second answer, past its session timeout:
    B takes the partition over and replays the run to its finish. When A wakes up, its answer
    comes in and its next append is refused (or its run is revoked first): nothing of A lands."""
    receiver = Receiver()
    with ScriptedServer(script(receiver.url, 8.0)) as server:
        a, a_port = worker(spawn, vigil_env, server, receiver, "worker-a")
        produce(stack.bootstrap, topics.events, [chat("bob", "refund B200")])
        wait_for(lambda: questions(server)["q2"] == 1, 30, "the second question to be asked")
        assert scraped(a_port, "vigil_runs_in_flight") == 1
        a.signal(signal.SIGSTOP)
        b, _ = worker(spawn, vigil_env, server, receiver, "worker-b", VIGIL_WORKER_PORT=str(free_port()))
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "B to finish the run")
        a.signal(signal.SIGCONT)
        # A's model call ends (the scripted delay) and it would append its answer, or finish:
        # whichever way A's run ends (refused, revoked, its finish stale), it is over once A
        # holds no run, and nothing of it can land after that (a scrape that fails is None).
        wait_for(lambda: scraped(a_port, "vigil_runs_in_flight") == 0, 60, "A's run to end")
        asked = questions(server)
    receiver.close()
    assert len(receiver.keys) == 1, receiver.keys
    assert scalar(ledger, "SELECT count(*) FROM outbox") == 1
    assert scalar(ledger, "SELECT count(*) FROM run_journal") == 0, "a late append of A landed"
    assert scalar(ledger, "SELECT count(*) FROM runs") == 1, "A's finish landed"
    assert_runs_consistent(ledger)
    assert asked["q1"] == 1 and asked["q3"] <= 2, asked
    log = a.log()
    assert "refused" in log or "revoked" in log or "stale" in log, log[-2000:]
    b.stop()


def test_the_ledger_lost_mid_run_on_the_last_attempt_is_not_the_events_death(stack, topics, ledger, vigil_env, spawn):
    """The run's connection to the ledger dies under it (PostgreSQL restarted, a failover: here
    its backend terminated while its journal append waits) on the event's last attempt. That
    is the ledger's outage, not the event's fault: the attempt is given back as a transient
    failure and the event is run again, its call made again under its one key, where it used
    to be ``dead`` (seen in the chaos run of 7 December, seed 1: a healthy event whose lone
    last attempt met a PostgreSQL kill)."""
    receiver = Receiver()
    with ScriptedServer(script(receiver.url)) as server:
        worker(spawn, vigil_env, server, receiver, "worker-a", VIGIL_MAX_ATTEMPTS="1")
        locked = Locked(ledger, "run_journal")
        produce(stack.bootstrap, topics.events, [chat("cid", "refund C300")])
        blocked = wait_for(lambda: backend_waiting(ledger, "run_journal"), 30, "a journal write to wait")
        query(ledger, "SELECT pg_terminate_backend(%s)", (blocked,))
        locked.release()
        wait_for(
            lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status IN ('done', 'dead')"),
            60,
            "the event to end",
        )
    receiver.close()
    row = query(ledger, "SELECT status, attempts, transient_failures, error FROM events")[0]
    assert row["status"] == "done", row
    assert (row["attempts"], row["transient_failures"]) == (1, 1), row
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox")] == ["Refund posted."]
    assert len(set(receiver.keys)) <= 1, receiver.keys
    runs = query(ledger, "SELECT outcome, error FROM runs ORDER BY id")
    assert [r["outcome"] for r in runs] == ["failed", "message"], runs
    assert runs[0]["error"].startswith("ledger unavailable: terminating connection"), runs


def test_the_journal_is_kept_for_operators_when_asked(stack, topics, ledger, vigil_env, spawn):
    """VIGIL_RUN_JOURNAL_DAYS keeps a finished run's steps: `vigil runs show` lists them."""
    receiver = Receiver()
    with ScriptedServer(script(receiver.url)) as server:
        _, _ = worker(spawn, vigil_env, server, receiver, "worker-a", VIGIL_RUN_JOURNAL_DAYS="3")
        produce(stack.bootstrap, topics.events, [chat("cy", "refund C300")])
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "the run to finish")
    receiver.close()
    rows = query(ledger, "SELECT run_key, step, kind, body::text AS body, outcome::text AS outcome FROM run_journal")
    assert [(r["step"], r["kind"]) for r in rows] == [(1, "model"), (2, "call"), (3, "model"), (5, "model")], rows
    (call,) = [r for r in rows if r["kind"] == "call"]
    assert json.loads(call["body"])["key"] == receiver.keys[0] == f"{call['run_key']}:2"
    assert scalar(ledger, "SELECT count(*) FROM run_journal WHERE finished_at IS NULL") == 0
    run_id = scalar(ledger, "SELECT id FROM runs")
    shown = subprocess.run(
        [sys.executable, "-m", "vigil", "runs", "show", str(run_id), "--json"],
        env={**os.environ, "VIGIL_DATABASE_URL": ledger},
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(shown.stdout)
    assert out["run"]["id"] == run_id and out["run_key"] == call["run_key"]
    assert [(s["step"], s["kind"]) for s in out["steps"]] == [(1, "model"), (2, "call"), (3, "model"), (5, "model")]
    assert out["steps"][0]["tools_called"] == ["http_request"]
    assert out["steps"][1]["idempotency_key"] == receiver.keys[0] and out["steps"][1]["outcome"] == "ok"
    by_key = subprocess.run(
        [sys.executable, "-m", "vigil", "runs", "show", call["run_key"], "--json"],
        env={**os.environ, "VIGIL_DATABASE_URL": ledger},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(by_key.stdout)["run"]["id"] == run_id, "a finished run is found by the key it was shown under"
    missing = subprocess.run(
        [sys.executable, "-m", "vigil", "runs", "show", "999999"],
        env={**os.environ, "VIGIL_DATABASE_URL": ledger},
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "no run 999999" in missing.stderr


@pytest.mark.partitions(4)
def test_a_rolling_restart_under_load_gives_no_call_two_keys(stack, topics, ledger, vigil_env, spawn):
    """Two workers with runs in flight (each a POST between two slow model answers) are replaced
    one by one: SIGTERM with a short grace, as a deploy does. Runs cut off mid-way are replayed
    by the next owner: every logical call reaches the receiver under one key."""
    receiver = Receiver()
    users = [f"roll{i:02d}" for i in range(24)]
    rules = script(receiver.url)["rules"]
    for rule in rules:
        rule["delay"] = [0.5, 1.5]
    # Every run asks its second question (after its POST) slowly the first time: a run that has
    # posted is in flight, with a journal to replay, whenever a rebalance or a stop cuts it off.
    # (Slow answers alone left it to the machine's speed: CI once saw no run cut off after its POST.)
    posted = next(i for i, rule in enumerate(rules) if rule.get("when", {}).get("tool_result") == "http_request")
    rules.insert(posted, {**rules[posted], "times": len(users), "delay": 12})
    with ScriptedServer({"rules": rules}) as server:
        grace = {"VIGIL_SHUTDOWN_GRACE_S": "3", "VIGIL_REVOKE_GRACE_S": "1"}
        procs = {}
        for name in ("old-1", "old-2"):
            procs[name], _ = worker(
                spawn, vigil_env, server, receiver, name, VIGIL_WORKER_PORT=str(free_port()), **grace
            )
        produce(stack.bootstrap, topics.events, [chat(u, f"refund R{n}") for n, u in enumerate(users)])
        wait_for(lambda: len(receiver.keys) >= 4, 30, "calls in flight")
        for old, new in (("old-1", "new-1"), ("old-2", "new-2")):
            procs[new], _ = worker(spawn, vigil_env, server, receiver, new, VIGIL_WORKER_PORT=str(free_port()), **grace)
            time.sleep(2)
            assert procs[old].stop(30) == 0
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox") == len(users), 120, "every run to finish")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status <> 'done'") == 0, 30)
    receiver.close()
    by_user: dict[str, set[str]] = {}
    for key in receiver.keys:
        by_user.setdefault(key.split(":")[0], set()).add(key)
    assert set(by_user) == set(users)
    assert all(len(keys) == 1 for keys in by_user.values()), {u: k for u, k in by_user.items() if len(k) > 1}
    assert scalar(ledger, "SELECT count(*) FROM outbox") == len(users)
    assert_runs_consistent(ledger)
    assert scalar(ledger, "SELECT count(*) FROM run_journal") == 0
    replays = sum(proc.log().count("replaying the run's journal") for proc in procs.values())
    assert replays >= 1, "no run was cut off mid-way: the test proved nothing"


def test_a_task_retried_after_its_holder_died_does_not_act_again(stack, topics, ledger, vigil_env, spawn):
    """A run delegates a background task that POSTs; the worker holding the task is SIGKILLed
    after the POST came back, while the child waits for its next answer. Another worker takes
    the task back after VIGIL_TASK_STALE_S and replays its journal: no second POST."""
    receiver = Receiver()
    post = {
        "type": "tool_use",
        "name": "http_request",
        "input": {"method": "POST", "url": f"{receiver.url}/tickets", "body": "{}"},
    }
    answer = {"when": {"system": "sub-agent", "tool_result": "http_request"}, "reply": [{"type": "text", "text": "ok"}]}
    rules = [
        {**answer, "times": 1, "delay": 60},  # the first holder dies waiting for this one
        answer,
        {"when": {"system": "sub-agent", "user_text": "open a ticket"}, "reply": [post]},
        {"when": {"tool_result": "delegate"}, "reply": []},
        {
            "when": {"user_text": "please delegate"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "delegate",
                    "input": {"instructions": "open a ticket", "mode": "background", "tools": ["http_request"]},
                }
            ],
        },
        {"reply": []},  # the task's result, when it wakes the session
    ]
    fast = {"VIGIL_TASK_HEARTBEAT_S": "0.5", "VIGIL_TASK_STALE_S": "2"}
    with ScriptedServer({"rules": rules}) as server:
        a, _ = worker(spawn, vigil_env, server, receiver, "worker-a", **fast)
        produce(stack.bootstrap, topics.events, [chat("tia", "please delegate")])
        wait_for(lambda: receiver.keys, 30, "the task's POST")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM run_journal WHERE outcome IS NOT NULL"), 10)
        # A dies waiting for the delayed answer, so it must have asked for it: killed before
        # (a clean-clone run under heavy load), it left that answer to B, which then waited 60 s.
        wait_for(
            lambda: any(
                "sub-agent" in json.dumps(b.get("system")) and len(b["messages"]) >= 3 for b in server.requests()
            ),
            30,
            "the child's question after its POST",
        )
        a.kill()
        _, _ = worker(spawn, vigil_env, server, receiver, "worker-b", **fast)
        wait_for(lambda: scalar(ledger, "SELECT status FROM tasks") == "succeeded", 60, "the task to succeed on B")
        child_questions = [
            b for b in server.requests() if "sub-agent" in json.dumps(b.get("system")) and len(b["messages"]) == 1
        ]
    receiver.close()
    assert len(receiver.keys) == 1, receiver.keys
    assert receiver.keys[0].startswith("task:"), receiver.keys
    assert len(child_questions) == 1, "the child's first question was asked again"
    assert scalar(ledger, "SELECT attempts FROM tasks") == 2
    assert scalar(ledger, "SELECT count(*) FROM run_journal WHERE run_key LIKE 'task:%%'") == 0


# (first holder's journal, second holder's journal): each holder is its own worker process.
HOLDERS = [("on", "on"), ("off", "off"), ("off", "on")]


@pytest.mark.parametrize("journals", HOLDERS, ids=["-".join(j) for j in HOLDERS])
def test_a_task_key_names_one_call_whoever_holds_it(journals, stack, topics, ledger, vigil_env, spawn):
    """A background task POSTs; its holder is SIGKILLed while the POST is in flight (in doubt)
    and another worker takes the task back. The model answers the child's first question
    with POST /first once, then with POST /second. No key is ever given to two calls:

    - journal on for both: the second holder replays the answer and makes the call in doubt
      again under the same key (one logical call, one key: the system it acts on drops it);
    - the first holder without a journal: nothing of it is replayed, the second holder asks
      again and POSTs /second, under a key of its own (the lease epoch is in it), with or
      without a journal of its own."""
    first, second = (
        {"VIGIL_RUN_JOURNAL": "false", "VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS": "accept"} if j == "off" else {}
        for j in journals
    )
    receiver = Receiver()

    def post(path: str) -> dict:
        return {
            "type": "tool_use",
            "name": "http_request",
            "input": {"method": "POST", "url": f"{receiver.url}{path}", "body": "{}"},
        }

    child = {"system": "sub-agent", "user_text": "open a ticket"}
    rules = [
        {"when": {"system": "sub-agent", "tool_result": "http_request"}, "reply": [{"type": "text", "text": "ok"}]},
        {"when": child, "reply": [post("/first")], "times": 1},
        {"when": child, "reply": [post("/second")]},
        {"when": {"tool_result": "delegate"}, "reply": []},
        {
            "when": {"user_text": "please delegate"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "delegate",
                    "input": {"instructions": "open a ticket", "mode": "background", "tools": ["http_request"]},
                }
            ],
        },
        {"reply": []},  # the task's result, when it wakes the session
    ]
    fast = {"VIGIL_TASK_HEARTBEAT_S": "0.5", "VIGIL_TASK_STALE_S": "2"}
    with ScriptedServer({"rules": rules}) as server:
        a, _ = worker(spawn, vigil_env, server, receiver, "worker-a", **fast, **first)
        receiver.hold.clear()  # the first holder's POST stays in flight: in doubt
        produce(stack.bootstrap, topics.events, [chat("tia", "please delegate")])
        wait_for(lambda: receiver.calls, 30, "the first holder's POST")
        a.kill()
        receiver.hold.set()
        worker(spawn, vigil_env, server, receiver, "worker-b", **fast, **second)
        wait_for(lambda: scalar(ledger, "SELECT status FROM tasks") == "succeeded", 60, "the task to succeed on B")
        asked = [b for b in server.requests() if "sub-agent" in json.dumps(b.get("system")) and len(b["messages"]) == 1]
    receiver.close()
    task = query(ledger, "SELECT id, attempts, lease_epoch FROM tasks")[0]
    assert (task["attempts"], task["lease_epoch"]) == (2, 2), task
    paths_of: dict[str, set[str]] = {}
    for path, key in receiver.calls:
        paths_of.setdefault(key, set()).add(path)
    assert all(len(paths) == 1 for paths in paths_of.values()), f"a key named two calls: {receiver.calls}"
    [(first_path, first_key), *later] = receiver.calls
    assert first_path == "/first" and later, receiver.calls
    if journals == ("on", "on"):
        assert receiver.calls == [("/first", f"task:{task['id']}:2")] * 2, "the call in doubt got another key"
        assert len(asked) == 1, "the child's first question was asked again"
    else:
        assert first_key == f"task:{task['id']}~1:2", first_key
        own = f"task:{task['id']}~2:2" if journals[1] == "off" else f"task:{task['id']}:2"
        assert later == [("/second", own)], receiver.calls
        assert len(asked) == 2, "nothing was journaled: the child's first question is asked again"


def test_without_the_journal_a_run_released_for_an_overloaded_model_acts_under_new_keys(
    stack, topics, ledger, vigil_env, spawn
):
    """Journal off (accepted): a run POSTs /first, then the model is overloaded, so its claim
    is released without counting an attempt (RetryLater). The retry asks the model again and
    POSTs /second at the same step: under a key of its own, never the one /first had."""
    receiver = Receiver()

    def post(path: str) -> dict:
        body = {"method": "POST", "url": f"{receiver.url}{path}", "body": "{}"}
        return {"type": "tool_use", "name": "http_request", "input": body}

    done = [{"type": "tool_use", "name": "send_message", "input": {"text": "Done."}}]
    rules = [
        {"when": {"tool_result": "send_message"}, "reply": []},
        {"when": {"tool_result": "http_request"}, "error": {"status": 529, "retry_after": 0}, "times": 1},
        {"when": {"tool_result": "http_request"}, "reply": done},
        {"when": {"user_text": "refund"}, "reply": [post("/first")], "times": 1},
        {"when": {"user_text": "refund"}, "reply": [post("/second")]},
    ]
    off = {"VIGIL_RUN_JOURNAL": "false", "VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS": "accept", "VIGIL_MODEL_RETRIES": "0"}
    with ScriptedServer({"rules": rules}) as server:
        worker(spawn, vigil_env, server, receiver, "worker-a", **off)
        produce(stack.bootstrap, topics.events, [chat("uma", "refund A17")])
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox") == 1, 60, "the run's message")
    receiver.close()
    assert scalar(ledger, "SELECT attempts FROM events") == 1, "the overloaded model counted an attempt"
    [(first, first_key), (second, second_key)] = receiver.calls
    assert (first, second) == ("/first", "/second"), receiver.calls
    assert first_key != second_key, f"one key named two calls: {receiver.calls}"


def test_no_journal_with_tools_that_act_is_refused_unless_accepted(spawn, vigil_env):
    """VIGIL_RUN_JOURNAL=false with tools that act (http_request, the demo's refund package) is a
    start-up error naming the setting and the tools; an operator's VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS
    =accept starts it; the echo agent, which calls no tools, starts without a journal."""
    with ScriptedServer({"rules": [{"reply": []}]}) as server:
        tools = {"VIGIL_HTTP_ALLOWED_HOSTS": "127.0.0.1:9", "VIGIL_RUN_JOURNAL": "false"}
        refused = spawn(["worker"], claude_env(vigil_env, server.base_url, **tools), name="refused")
        refused.proc.wait(30)
        log = refused.log()
        assert refused.proc.returncode == 2, log[-3000:]
        assert "VIGIL_RUN_JOURNAL=false" in log and "http_request" in log and "refund" in log, log[-3000:]
        assert "VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS=accept" in log and "Traceback" not in log, log[-3000:]
        env = claude_env(vigil_env, server.base_url, **tools, VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS="accept")
        spawn(["worker"], env, name="accepted").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
    echo = {**vigil_env, "VIGIL_AGENT": "echo", "VIGIL_RUN_JOURNAL": "false", "VIGIL_WORKER_PORT": str(free_port())}
    spawn(["worker"], echo, name="echo").wait_healthy(int(echo["VIGIL_WORKER_PORT"]))


@pytest.mark.parametrize("handover", ["step", "finish"])
def test_a_stopping_worker_hands_its_runs_over(handover, stack, topics, ledger, vigil_env, spawn):
    """SIGTERM while a run waits for its second answer (6 s). ``step``: the worker stops the run
    once that answer is journaled, releases it and exits; the next owner replays it and asks
    only the third question. ``finish``: the worker finishes the run itself first. Either way
    each question is asked once and the call is made once."""
    receiver = Receiver()
    with ScriptedServer(script(receiver.url, 6.0)) as server:
        a, a_port = worker(
            spawn, vigil_env, server, receiver, "worker-a", VIGIL_HANDOVER=handover, VIGIL_SHUTDOWN_GRACE_S="30"
        )
        produce(stack.bootstrap, topics.events, [chat("hal", "refund H1")])
        wait_for(lambda: questions(server)["q2"] == 1, 30, "the second question to be asked")
        began = time.monotonic()
        assert a.stop(40) == 0
        stopped_in = time.monotonic() - began
        b, _ = worker(spawn, vigil_env, server, receiver, "worker-b", VIGIL_HANDOVER=handover)
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "the run to finish")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status <> 'done'") == 0, 30)
        asked = questions(server)
    receiver.close()
    assert asked == {"q1": 1, "q2": 1, "q3": 1}, asked
    assert len(receiver.keys) == 1
    worker_of_run = scalar(ledger, "SELECT worker FROM runs")
    assert worker_of_run == ("worker-b" if handover == "step" else "worker-a")
    assert "handed over" not in a.log() or handover == "step"
    assert stopped_in < 20, stopped_in
    b.stop()


def test_a_replayed_run_writes_its_sync_task_row_once(stack, topics, ledger, vigil_env, spawn):
    """A run's sync child is mid-conversation (its second question answered only after 60 s)
    when worker A is SIGKILLed: its row is `running`. Worker B replays the run from its journal:
    the same row (its id derived from the delegate call's step key) ends `succeeded`, its second
    attempt; no second row, and the child's first question is not asked again."""
    receiver = Receiver()
    child = {"system": "sub-agent"}
    answer = {"when": {**child, "tool_result": "http_request"}, "reply": [{"type": "text", "text": "posted"}]}
    post = {"type": "tool_use", "name": "http_request", "input": {"method": "POST", "url": f"{receiver.url}/t"}}
    rules = [
        {**answer, "times": 1, "delay": 60},  # A dies waiting for this one
        answer,
        {"when": {**child, "user_text": "^post it$"}, "reply": [post]},
        {"when": {"tool_result": "delegate"}, "reply": []},
        {
            "when": {"user_text": "please post"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "delegate",
                    "input": {"instructions": "post it", "mode": "sync", "tools": ["http_request"]},
                }
            ],
        },
    ]
    with ScriptedServer({"rules": rules}) as server:
        a, _ = worker(spawn, vigil_env, server, receiver, "worker-a")
        produce(stack.bootstrap, topics.events, [chat("syd", "please post")])
        wait_for(lambda: receiver.keys, 60, "the child's POST")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM run_journal WHERE outcome IS NOT NULL"), 10)
        assert scalar(ledger, "SELECT status FROM tasks") == "running"
        a.kill()
        worker(spawn, vigil_env, server, receiver, "worker-b")
        wait_for(lambda: scalar(ledger, "SELECT status FROM tasks") == "succeeded", 90, "the row to end on B")
        first_questions = [
            b for b in server.requests() if "sub-agent" in json.dumps(b.get("system")) and len(b["messages"]) == 1
        ]
    receiver.close()
    [row] = query(ledger, "SELECT * FROM tasks")
    assert (row["mode"], row["attempts"], row["result"], row["depth"]) == ("sync", 2, "posted", 1), row
    assert row["turns"] == 2 and row["input_tokens"] > 0 and row["last_tool"] == "http_request"
    assert len(receiver.keys) == 1, receiver.keys
    assert len(first_questions) == 1, "the child's first question was asked again"


def test_a_sync_child_handed_over_is_not_recorded_failed(stack, topics, ledger, vigil_env, spawn):
    """Worker A stops (VIGIL_HANDOVER=step) while a run's sync child waits for its first answer
    (6 s): the answer is journaled, the child stops before its POST and the run is handed
    over. The child's row stays `running` (it did not fail: a replay takes it up), and B's
    replay ends it `succeeded` with the one POST."""
    receiver = Receiver()
    child = {"system": "sub-agent"}
    post = {"type": "tool_use", "name": "http_request", "input": {"method": "POST", "url": f"{receiver.url}/t"}}
    ask = {"when": {**child, "user_text": "^post it$"}, "reply": [post]}
    rules = [
        {"when": {**child, "tool_result": "http_request"}, "reply": [{"type": "text", "text": "posted"}]},
        {**ask, "times": 1, "delay": 6},  # A is stopped waiting for this one
        ask,
        {"when": {"tool_result": "delegate"}, "reply": []},
        {
            "when": {"user_text": "please post"},
            "reply": [
                {
                    "type": "tool_use",
                    "name": "delegate",
                    "input": {"instructions": "post it", "mode": "sync", "tools": ["http_request"]},
                }
            ],
        },
    ]
    with ScriptedServer({"rules": rules}) as server:
        a, _ = worker(
            spawn, vigil_env, server, receiver, "worker-a", VIGIL_HANDOVER="step", VIGIL_SHUTDOWN_GRACE_S="30"
        )
        produce(stack.bootstrap, topics.events, [chat("sol", "please post")])
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM tasks") == 1, 60, "the child's row")
        assert a.stop(40) == 0
        [row] = query(ledger, "SELECT status, error FROM tasks")
        assert (row["status"], row["error"]) == ("running", None), row
        assert receiver.keys == []
        worker(spawn, vigil_env, server, receiver, "worker-b", VIGIL_HANDOVER="step")
        wait_for(lambda: scalar(ledger, "SELECT status FROM tasks") == "succeeded", 90, "the row to end on B")
    receiver.close()
    [row] = query(ledger, "SELECT * FROM tasks")
    assert (row["mode"], row["attempts"], row["result"]) == ("sync", 2, "posted"), row
    assert len(receiver.keys) == 1, receiver.keys


def posted_then_asking(stack, topics, ledger, vigil_env, spawn, server, receiver, **extra):
    """Worker A runs ann's "refund A100" until its POST's outcome is journaled and the second
    question (held by the script) is in flight: a run to kill mid-way. Returns A."""
    a, _ = worker(spawn, vigil_env, server, receiver, "worker-a", **extra)
    produce(stack.bootstrap, topics.events, [chat("ann", "refund A100")])
    wait_for(lambda: questions(server)["q2"] == 1, 30, "the second question to be asked")
    wait_for(lambda: scalar(ledger, "SELECT count(*) FROM run_journal WHERE outcome IS NOT NULL"), 10)
    return a


def vigil_cli(ledger: str, *args: str) -> str:
    env = {**os.environ, "VIGIL_DATABASE_URL": ledger}
    done = subprocess.run([sys.executable, "-m", "vigil", *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_run_replayed_after_its_profile_was_updated_keeps_its_version(stack, topics, ledger, vigil_env, spawn):
    def profiles(*args: str) -> None:
        vigil_cli(ledger, "profiles", *args)

    profiles("create", "refunds", "--model", "claude-v1", "--tools", "http_request=allow,send_message=allow")
    profiles("assign", "ann", "refunds")
    receiver = Receiver()
    with ScriptedServer(script(receiver.url, 60.0)) as server:
        a = posted_then_asking(stack, topics, ledger, vigil_env, spawn, server, receiver)
        profiles("update", "refunds", "--model", "claude-v2")  # v2 while the run is in flight
        a.kill()  # SIGKILL mid-run, after the update

        b, _ = worker(spawn, vigil_env, server, receiver, "worker-b")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "the run to finish on B")
        models = [body["model"] for body in server.requests()]
    receiver.close()
    assert models == ["claude-v1"] * 4, models  # q1, q2 (A), q2 again and q3 (B): v1 throughout
    assert len(receiver.keys) == 1, receiver.keys  # the journaled POST is not made again
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox")] == ["Refund posted."]
    [run] = query(ledger, "SELECT profile, profile_version FROM runs")
    assert (run["profile"], run["profile_version"]) == ("refunds", 1), run  # the version it started with
    b.stop()


def test_an_upgraded_run_goes_on_under_the_new_version_and_repeats_nothing(stack, topics, ledger, vigil_env, spawn):
    """`vigil runs upgrade` moves the in-flight run to v2, whose prompt, model and tool set
    differ (http_request gone): the replay keeps the journaled POST as a fact (its result in the
    transcript, not executed again) and asks what is left under v2."""
    tools_v1 = "http_request=allow,send_message=allow"
    vigil_cli(
        ledger,
        "profiles",
        "create",
        "refunds",
        "--model",
        "claude-v1",
        "--system-prompt",
        "Desk v1.",
        "--tools",
        tools_v1,
    )
    vigil_cli(ledger, "profiles", "assign", "ann", "refunds")
    receiver = Receiver()
    with ScriptedServer(script(receiver.url, 60.0)) as server:
        a = posted_then_asking(stack, topics, ledger, vigil_env, spawn, server, receiver)
        a.kill()
        vigil_cli(
            ledger,
            "profiles",
            "update",
            "refunds",
            "--model",
            "claude-v2",
            "--system-prompt",
            "Desk v2.",
            "--tools",
            "send_message=allow",
        )
        moved = json.loads(vigil_cli(ledger, "runs", "upgrade", "--profile", "refunds", "--to-version", "2", "--json"))

        b, b_port = worker(spawn, vigil_env, server, receiver, "worker-b")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "the run to finish on B")
        requests = server.requests()
        upgraded = metric(b_port, "vigil_runs_upgraded_total", 'profile="refunds"')
    receiver.close()
    b.stop()
    [run] = moved["runs"]
    assert (moved["moved"], run["from_version"], run["calls_done"]) == (1, 1, 1), moved
    # q1 and q2 on A under v1; q2 again and q3 on B under v2: its model, prompt and tools.
    assert [body["model"] for body in requests] == ["claude-v1", "claude-v1", "claude-v2", "claude-v2"]
    for body in requests[2:]:
        assert "Desk v2." in json.dumps(body["system"]) and "Desk v1." not in json.dumps(body["system"])
        assert "http_request" not in [t["name"] for t in body["tools"]]
    assert len(receiver.keys) == 1, receiver.keys  # the journaled POST is a fact: not made again
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox")] == ["Refund posted."]
    [row] = query(ledger, "SELECT profile, profile_version FROM runs")
    assert (row["profile"], row["profile_version"]) == ("refunds", 2), row
    assert upgraded == 1


def test_a_call_in_doubt_whose_tool_is_gone_at_replay_is_an_error_the_model_reads(
    stack, topics, ledger, vigil_env, spawn
):
    """Worker A dies while its POST is in flight (intent journaled, no outcome); worker B no
    longer has http_request: the replay does not make the call again, does not start the run
    over, and the model reads an error result saying what happened."""
    receiver = Receiver()
    receiver.hold.clear()
    with ScriptedServer(script(receiver.url)) as server:
        a, _ = worker(spawn, vigil_env, server, receiver, "worker-a", VIGIL_RUN_JOURNAL_DAYS="1")
        produce(stack.bootstrap, topics.events, [chat("ann", "refund A100")])
        wait_for(lambda: len(receiver.keys) == 1, 30, "the POST to be in flight")
        a.kill()
        receiver.hold.set()
        b, b_port = worker(
            spawn,
            vigil_env,
            server,
            receiver,
            "worker-b",
            VIGIL_RUN_JOURNAL_DAYS="1",
            VIGIL_TOOL_PERMISSIONS="http_request=deny",
        )
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "the run to finish on B")
        asked = questions(server)
        results = [
            block
            for body in server.requests()
            for block in body["messages"][-1]["content"]
            if isinstance(block, dict) and block.get("type") == "tool_result"
        ]
        replayed = metric(b_port, "vigil_run_replays_total", 'reason="replayed"')
    receiver.close()
    b.stop()
    assert len(receiver.keys) == 1, receiver.keys  # not made again
    assert asked["q1"] == 1, asked  # the journaled answer is not asked again: no start-over
    assert replayed == 1
    [gone] = [r for r in results if "http_request" in json.dumps(r["content"])]
    assert gone.get("is_error") is True, gone
    assert "Not run again" in json.dumps(gone["content"]) and "outcome is unknown" in json.dumps(gone["content"]), gone
    # One run key throughout (no "~<attempt>" start-over).
    assert [r["run_key"] for r in query(ledger, "SELECT DISTINCT run_key FROM run_journal")] == [
        f"ann:{scalar(ledger, 'SELECT min(id) FROM events')}"
    ]


def test_a_run_replayed_after_the_deployment_changed_its_model_keeps_the_recorded_one(
    stack, topics, ledger, vigil_env, spawn
):
    receiver = Receiver()
    with ScriptedServer(script(receiver.url, 60.0)) as server:
        a = posted_then_asking(stack, topics, ledger, vigil_env, spawn, server, receiver, VIGIL_MODEL="claude-v1")
        a.kill()
        start = json.loads(scalar(ledger, "SELECT body::text FROM run_journal WHERE step = 1"))["start"]

        b, b_port = worker(spawn, vigil_env, server, receiver, "worker-b", VIGIL_MODEL="claude-v2")
        wait_for(lambda: scalar(ledger, "SELECT count(*) FROM outbox"), 60, "the run to finish on B")
        models = [body["model"] for body in server.requests()]
        changed = metric(b_port, "vigil_runs_replayed_across_versions_total", 'changed="model"')
    receiver.close()
    b.stop()
    # What the run started with: the model, the tool set with versions, vigil's version.
    assert start["model"] == "claude-v1"
    assert start["tools"]["http_request"].startswith("vigil ") and "send_message" in start["tools"], start["tools"]
    assert start["vigil"]
    assert models == ["claude-v1"] * 4, models  # the deployment's v2 never reaches this run
    assert changed == 1
    assert len(receiver.keys) == 1, receiver.keys
