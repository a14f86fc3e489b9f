"""Promises where features meet, on real processes (issue 53): a poison event harms only
itself even when its run kept a journal, and a budget never drops an event.

Each test is named after what must not happen. README "Guarantees" lists them."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from support import LocalHTTPServer, query, wait_for
from vigil_dev.scripted_server import ScriptedServer
from worker_support import Supervisor, assert_runs_consistent, chat, claude_env, produce


class CrashingEndpoint:
    """A system the agent acts on, one of whose calls makes the worker die every time (as an
    out-of-memory kill or a native crash in a client library would): a POST to ``/crash``
    SIGKILLs every worker of the supervisor before it answers."""

    def __init__(self) -> None:
        self.supervisor: Supervisor | None = None
        self.crashes = 0
        self.keys: list[str] = []  # the Idempotency-Key of every call, in order
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                self.rfile.read(int(self.headers.get("content-length") or 0))
                endpoint.keys.append(self.headers.get("idempotency-key", ""))
                if self.path.startswith("/crash") and endpoint.supervisor is not None:
                    endpoint.crashes += 1
                    for proc in list(endpoint.supervisor.workers):
                        proc.kill()
                data = b'{"ok": true}'
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
        self.server.shutdown()


def poison_script(url: str, delay: float = 0.0) -> dict:
    """A message naming poison makes the model call the crashing endpoint (first rule that
    matches wins: a run holding the poison message calls it), after ``delay`` seconds; a
    hello is answered."""
    return {
        "rules": [
            {"when": {"tool_result": "send_message"}, "reply": []},
            {"when": {"tool_result": "http_request"}, "reply": []},
            {
                "when": {"user_text": "poison"},
                "delay": delay,
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "http_request",
                        "input": {"method": "POST", "url": f"{url}/crash", "body": "{}"},
                    }
                ],
            },
            {
                "when": {"user_text": "(?i)hello (?P<who>\\w+)"},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "hi {who}"}}],
            },
        ]
    }


def settled(dsn: str, count: int) -> bool:
    """All ``count`` events are recorded and each is done or dead."""
    rows = query(dsn, "SELECT status FROM events")
    return len(rows) == count and all(r["status"] in ("done", "dead") for r in rows)


class KillOnAsk(threading.Thread):
    """Kills the supervisor's workers whenever the model is asked about poison: the crash comes
    while the run's first step is in flight, before anything is journaled."""

    def __init__(self, server: ScriptedServer, supervisor: Supervisor):
        super().__init__(daemon=True)
        self.server, self.supervisor, self.stopped = server, supervisor, threading.Event()
        self.kills = 0

    def run(self) -> None:
        seen = 0
        while not self.stopped.wait(0.1):
            asked = [r for r in self.server.requests() if "poison" in json.dumps(r["messages"][-1])]
            if len(asked) > seen:
                seen = len(asked)
                self.kills += 1
                for proc in list(self.supervisor.workers):
                    proc.kill()


@pytest.mark.early
@pytest.mark.partitions(1)
@pytest.mark.parametrize("crash", ["after_its_first_step", "before_its_first_step"])
def test_a_poison_event_in_a_journaled_batch_kills_no_batch_mate(crash, stack, topics, ledger, vigil_env, spawn):
    """Three messages claimed as one run: ``hello one``, ``poison X``, ``hello two``. The
    poison kills the worker on every attempt: after the run journaled its first step (the
    model's answer, whose call kills it), or before (while the model is asked). The journal's
    replay takes the batch up again on the next attempts; the lone last attempt runs the
    suspect alone, journal or not (claim rule 3): the poison event ends dead with its reason,
    both healthy events done and answered. Before, after the first step, all three ended dead
    with three attempts each."""
    endpoint = CrashingEndpoint()
    # The three arrive before any worker: the first claim takes them together (one run).
    batch = [chat("pat", "hello one"), chat("pat", "poison X"), chat("pat", "hello two")]
    produce(stack.bootstrap, topics.events, batch)
    with ScriptedServer(poison_script(endpoint.url, 5.0 if crash == "before_its_first_step" else 0.0)) as server:
        env = claude_env(
            vigil_env,
            server.base_url,
            VIGIL_TOOL_PERMISSIONS="http_request=allow",
            VIGIL_HTTP_ALLOWED_HOSTS=endpoint.url.removeprefix("http://"),
        )
        supervisor = Supervisor(spawn, lambda: env, 1)
        killer = KillOnAsk(server, supervisor)
        if crash == "before_its_first_step":
            killer.start()
        else:
            endpoint.supervisor = supervisor
        try:
            wait_for(
                lambda: settled(ledger, 3),
                150,
                "every event done or dead",
                interval=0.5,
            )
            assert_poison_isolated(ledger, endpoint.crashes + killer.kills)
            if crash == "after_its_first_step":
                retry_after_the_users_next_run(endpoint, env, stack, topics, ledger)
        finally:
            killer.stopped.set()
            supervisor.stop()
            endpoint.close()
            for row in query(ledger, "SELECT id, status, attempts, lost_claims, error, payload FROM events"):
                print("event:", dict(row))


def assert_poison_isolated(ledger: str, crashes: int) -> None:
    by_text = {json.loads(r["payload"])["text"]: r for r in query(ledger, "SELECT payload, status, error FROM events")}
    assert by_text["poison X"]["status"] == "dead", by_text
    assert "dead after 3 attempts" in by_text["poison X"]["error"]
    assert by_text["hello one"]["status"] == "done", by_text
    assert by_text["hello two"]["status"] == "done", by_text
    assert sorted(r["body"] for r in query(ledger, "SELECT body FROM outbox")) == ["hi one", "hi two"]
    assert crashes >= 3  # the poison killed the worker on each of its attempts
    assert_runs_consistent(ledger)


def retry_after_the_users_next_run(endpoint: CrashingEndpoint, env, stack, topics, ledger) -> None:
    """The poison event died with its call in doubt. The user's next message runs, then an
    operator retries the dead event (the endpoint mended): its call goes out again under the
    key of the call in doubt, not a new one. Before, the next run ended the dead event's
    journal, and the retry made the call again under another key (issue 53)."""
    endpoint.supervisor = None  # the endpoint no longer crashes anyone
    in_doubt = endpoint.keys[-1]
    poison = query(ledger, "SELECT id FROM events WHERE status = 'dead'")[0]["id"]
    produce(stack.bootstrap, topics.events, [chat("pat", "hello three")])
    wait_for(lambda: settled(ledger, 4), 60, "the user's next message answered", interval=0.5)
    retried = subprocess.run(
        [sys.executable, "-m", "vigil", "dead", "retry", str(poison), "--actor", "oncall"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert retried.returncode == 0, retried.stderr
    wait_for(lambda: settled(ledger, 4), 60, "the retried event done", interval=0.5)
    assert query(ledger, "SELECT status FROM events WHERE id = %s", (poison,))[0]["status"] == "done"
    assert endpoint.keys[-1] == in_doubt, endpoint.keys
    assert_runs_consistent(ledger, retried=True)


HELLO = {
    "rules": [
        {"when": {"tool_result": "send_message"}, "reply": []},
        {
            "when": {"user_text": "hello"},
            "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "Hi!", "urgent": False}}],
        },
    ]
}


def test_a_budget_too_small_for_a_model_call_drops_no_event(spawn, vigil_env, ledger, stack, topics):
    """A user whose day left fewer tokens than one model call takes: what arrives next waits
    for the next day (pending, no attempt, one notice), it is never stored done by a run that
    made no call. Before, such runs started, stopped by their tokens budget before asking the
    model, and ended ``nothing`` with their events done: no reply, no notice, nothing kept.
    With a budget of 1 token, no message of the user is lost either."""
    from ingest_support import cli

    cli(ledger, "profiles", "create", "small", "--daily-tokens", "1000", "--system-prompt", "Be brief.")
    cli(ledger, "profiles", "assign", "bud/*", "small")
    cli(ledger, "profiles", "create", "one", "--daily-tokens", "1", "--system-prompt", "Be brief.")
    cli(ledger, "profiles", "assign", "one/*", "one")
    # Today's earlier runs billed 900 of the 1,000: 100 left, fewer than a model call takes
    # (MIN_CALL_TOKENS, 256).
    query(
        ledger,
        "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome,"
        " input_tokens) VALUES ('bud/dora', %s, 0, 1, 'earlier', '{}', now(), now(), 'message', 900)",
        (topics.events,),
    )
    with ScriptedServer(HELLO) as server:
        env = claude_env(vigil_env, server.base_url)
        spawn(["worker"], env, name="worker").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
        produce(
            stack.bootstrap,
            topics.events,
            [chat("bud/dora", "hello")] + [chat("one/olga", f"hi {i}") for i in range(3)],
        )

        def waiting(user: str) -> int:
            return query(
                ledger,
                "SELECT count(*) AS n FROM events WHERE user_id = %s AND status = 'pending'"
                " AND error LIKE 'budget: %%' AND attempts = 0 AND next_attempt_at > now() + interval '1 minute'",
                (user,),
            )[0]["n"]

        try:
            wait_for(lambda: waiting("bud/dora") == 1 and waiting("one/olga") == 3, 60, "the events waiting")
        finally:
            for row in query(ledger, "SELECT id, user_id, status, attempts, error FROM events"):
                print("event:", dict(row))
        assert server.requests() == []  # no model call past the budget
    assert query(ledger, "SELECT count(*) AS n FROM events WHERE status = 'done'")[0]["n"] == 0
    notices = query(ledger, "SELECT user_id FROM outbox WHERE run_id = 0 ORDER BY user_id")
    assert [n["user_id"] for n in notices] == ["bud/dora", "one/olga"]  # each told once
    assert query(ledger, "SELECT count(*) AS n FROM runs")[0]["n"] == 1  # the earlier one: a refusal is no run


class KillWhileRunning:
    """An endpoint whose call kills the worker once the watched event runs while the calling
    task still executes (the crash lands on whatever runs beside the task); a caller that goes
    away first is let go."""

    def __init__(self, dsn: str, watched: str, task: str) -> None:
        self.supervisor: Supervisor | None = None
        self.kills = self.calls = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                self.rfile.read(int(self.headers.get("content-length") or 0))
                endpoint.calls += 1
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    both = query(
                        dsn,
                        "SELECT (SELECT status FROM events WHERE source_id = %s) AS event,"
                        " (SELECT status FROM tasks WHERE id = %s) AS task",
                        (watched, task),
                    )[0]
                    # The task's code kills its process while it executes beside the event.
                    if both == {"event": "running", "task": "running"} and endpoint.supervisor is not None:
                        endpoint.kills += 1
                        for proc in list(endpoint.supervisor.workers):
                            proc.kill()
                        return
                    readable, _, _ = select.select([self.connection], [], [], 0.1)
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        return  # the caller went away (its task was handed back)

            def log_message(self, *args):
                pass

        self.server = LocalHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.mark.partitions(1)
def test_a_background_task_never_crashes_a_lone_last_attempt(stack, topics, ledger, vigil_env, spawn):
    """A lost event's last attempt runs with nothing else in flight in its worker, background
    tasks included: the drain before it waits for the tasks in flight (up to
    VIGIL_LONE_DRAIN_S) and hands the rest back, and no task is claimed while it runs. Here a
    task's call kills the worker whenever the event is running: the event must end done, not
    dead. Before, tasks were no part of the drain, the task's crash took the lone attempt down
    and the healthy event died."""
    query(ledger, "INSERT INTO users (user_id, home_topic, home_partition) VALUES ('lone', %s, 0)", (topics.events,))
    query(
        ledger,
        """INSERT INTO events (user_id, source, source_id, kind, payload, received_at, attempts, lost_claims,
                               next_attempt_at, error)
           VALUES ('lone', 'chat', 'lost-twice', 'chat.message', '{"text": "hello again"}', now(), 2, 2,
                   now() + interval '4 seconds', 'claim abandoned: its worker lost partition 0')""",
    )
    endpoint = KillWhileRunning(ledger, "lost-twice", "tsk-crash")
    query(
        ledger,
        "INSERT INTO tasks (id, user_id, parent_run_key, depth, owner_chain, instructions, tools, token_budget,"
        " max_attempts, deadline) VALUES ('tsk-crash', 'other', 'other:1', 1, '{other}', 'crash call',"
        " '{http_request}', 5000, 3, now() + interval '10 minutes')",
    )
    script = {
        "rules": [
            {"when": {"tool_result": "send_message"}, "reply": []},
            {"when": {"tool_result": "http_request"}, "reply": [{"type": "text", "text": "called"}]},
            {
                "when": {"user_text": "crash call"},
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "http_request",
                        "input": {"method": "POST", "url": f"{endpoint.url}/crash", "body": "{}"},
                    }
                ],
            },
            {
                "when": {"user_text": "hello (?P<who>\\w+)"},
                "delay": 2.0,
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "hi {who}"}}],
            },
        ]
    }
    with ScriptedServer(script) as server:
        env = claude_env(
            vigil_env,
            server.base_url,
            VIGIL_TOOL_PERMISSIONS="http_request=allow",
            VIGIL_HTTP_ALLOWED_HOSTS=endpoint.url.removeprefix("http://"),
            VIGIL_LONE_DRAIN_S="2",
        )
        supervisor = Supervisor(spawn, lambda: env, 1)
        endpoint.supervisor = supervisor
        try:
            wait_for(
                lambda: (
                    query(ledger, "SELECT status FROM events WHERE source_id = 'lost-twice'")[0]["status"]
                    in ("done", "dead")
                ),
                90,
                "the lone attempt's end",
                interval=0.3,
            )
        finally:
            supervisor.stop()
            endpoint.close()
    row = query(ledger, "SELECT status, attempts, error FROM events WHERE source_id = 'lost-twice'")[0]
    assert row["status"] == "done", row
    assert endpoint.calls >= 1  # the task was in flight, its call waiting for the event to run
    assert endpoint.kills == 0
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox WHERE user_id = 'lone'")] == ["hi again"]
