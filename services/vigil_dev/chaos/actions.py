"""The chaos run's agent acts on a system of its own: durable runs under faults.

Every run of the chaos load is a Claude run on the stack's scripted Messages API: it POSTs
the first message of its events to this receiver (``http_request``, allowed), then sends its
reply. The receiver is the system a real agent would act on: it records every request's
``Idempotency-Key``. The invariants: **no logical call is seen under two different keys, and
no key names two calls**. A logical call is the run's first message (a run's identity is its
first event), so a run replayed after a worker was killed, frozen, revoked or stopped repeats
a call only with the key it had (docs/worker.md, "Durable runs"); a call made again in doubt
is counted as a repeat, which is allowed.

**Poison.** A run whose events hold the poison marker (:data:`vigil_dev.chaos.load.POISON`)
POSTs to the receiver's ``/poison`` instead, and the receiver SIGKILLs the worker that called
(found by the connection's port), as an out-of-memory kill or a native crash would, every
time; a supervisor (:class:`vigil_dev.chaos.stack.Supervisor`) brings it back. The poison
event must end ``dead`` after its attempts, and no healthy event with it.

**Tasks.** A run whose events ask for a task (:data:`vigil_dev.chaos.load.TASK`) delegates a
background task and replies; the task's child POSTs ``task for <message>`` to the receiver
(its key ``task:<id>:<step>``), a logical call of its own under the same two invariants,
then answers. Its result event wakes the conversation, which ends without a call.

**Approvals.** The approval users' profile asks before every ``http_request``: their runs
defer the call, and the call runs after a yes, with the request id as its key
(vigil_dev.chaos.approvals).

**MCP.** A run whose events hold a message numbered 10, 20, ... asks the dev stack's MCP
stdio server (``shop``) instead of acting, and replies with what it read (or the error
result, the server killed under it by the nemesis's ``kill-mcp``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vigil_dev.chaos.load import POISON, TASK

# The receiver's path whose caller dies.
POISON_PATH = "/poison"
# The dev stack's MCP stdio server's tool (vigil_dev.mcp_demo_server, read-only: allowed).
MCP_TOOL = "shop__order_status"


class Receiver:
    """POSTs on 127.0.0.1: (key, body) of each, in arrival order. A POST to
    :data:`POISON_PATH` is handed to ``poison`` with the caller's port (which kills the
    caller), never answered and not recorded."""

    def __init__(self, poison: Callable[[int], None] | None = None) -> None:
        self.seen: list[tuple[str, str]] = []
        self.poison = poison  # set once the stack it kills in is up
        self.poisoned = 0  # poison calls received (each killed its caller)
        lock = threading.Lock()
        seen = self.seen
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                if length == 0 or len(raw) < length:
                    return  # cut off mid-request (its worker killed): it never arrived, nothing acted
                if self.path == POISON_PATH:
                    with lock:
                        receiver.poisoned += 1
                    if receiver.poison is not None:
                        receiver.poison(self.client_address[1])
                    self.close_connection = True
                    return  # no answer: the caller is dead (or, not found, gets a cut connection)
                with lock:
                    seen.append((self.headers.get("Idempotency-Key") or "", raw.decode(errors="replace")))
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the worker was killed while it acted: the call is in doubt, as meant

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 1024

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]
        self.host = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, name="chaos-receiver", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()

    def keys_by_call(self) -> dict[str, set[str]]:
        calls: dict[str, set[str]] = defaultdict(set)
        for key, body in list(self.seen):
            calls[body].add(key)
        return calls

    def calls_by_key(self) -> dict[str, set[str]]:
        keys: dict[str, set[str]] = defaultdict(set)
        for key, body in list(self.seen):
            keys[key].add(body)
        return keys


def script(host: str) -> dict:
    """The scripted model: the events -> POST their first message; its result -> a reply; done."""
    return {
        "rules": [
            # First: a poison event among the run's new events (its first turn, or folded in
            # later) kills the worker before anything else, on every attempt.
            {
                "when": {"user_text": POISON},
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "http_request",
                        "input": {"method": "POST", "url": f"http://{host}{POISON_PATH}", "body": "die"},
                    }
                ],
            },
            # A background task's child (its system prompt is the sub-agent's): act, then answer.
            {"when": {"system": "sub-agent", "tool_result": "http_request"}, "reply": [{"type": "text", "text": "ok"}]},
            {
                "when": {"system": "sub-agent", "user_text": "^(?P<t>task for .+)$"},
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "http_request",
                        "input": {"method": "POST", "url": f"http://{host}/task", "body": "{t}"},
                    }
                ],
            },
            {"when": {"tool_result": "send_message"}, "reply": []},
            {
                "when": {"tool_result": "http_request"},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "acted", "urgent": True}}],
            },
            {
                "when": {"tool_result": MCP_TOOL},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "looked up", "urgent": True}}],
            },
            {
                "when": {"tool_result": "delegate"},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "delegated", "urgent": True}}],
            },
            {
                "when": {"user_text": f'"text": "(?P<m>message [0-9]+ from [^" ]+) {TASK}"'},
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "delegate",
                        "input": {"instructions": "task for {m}", "mode": "background", "tools": ["http_request"]},
                    }
                ],
            },
            # A run with a message numbered 10, 20, ... asks the stack's MCP stdio server, whose
            # process the nemesis kills (kill-mcp): the next call starts it again.
            {
                "when": {"user_text": '"text": "message [0-9]*0 from '},
                "reply": [{"type": "tool_use", "name": MCP_TOOL, "input": {"order_id": "A-1001"}}],
            },
            {
                "when": {"user_text": '"text": "(?P<m>message [0-9]+ from [^"]+)"'},
                "reply": [
                    {
                        "type": "tool_use",
                        "name": "http_request",
                        "input": {"method": "POST", "url": f"http://{host}/act", "body": "{m}"},
                    }
                ],
            },
            {"reply": []},
        ]
    }


# The approval users' questions expire this soon (VIGIL_APPROVAL_DEADLINE_S): within the
# run, so that the expiry happens under faults too and every request ends before the settling.
APPROVAL_DEADLINE_S = 30


def environment(host: str) -> dict[str, str]:
    """The workers' settings for the acting agent."""
    return {
        "VIGIL_AGENT": "claude",
        "VIGIL_APPROVAL_DEADLINE_S": str(APPROVAL_DEADLINE_S),
        "VIGIL_TOOL_PERMISSIONS": "http_request=allow",
        "VIGIL_HTTP_ALLOWED_HOSTS": host,
        "VIGIL_OUTBOUND_ALLOWED_NETS": "127.0.0.0/8",
    }
