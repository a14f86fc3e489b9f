"""The chaos run's agent acts on a system of its own: durable runs under faults.

Every run of the chaos load is a Claude run on the stack's scripted Messages API: it POSTs
the first message of its events to this receiver (``http_request``, allowed), then sends its
reply. The receiver is the system a real agent would act on: it records every request's
``Idempotency-Key``. The invariant: **no logical call is seen under two different keys**.
A logical call is the run's first message (a run's identity is its first event), so a run
replayed after a worker was killed, frozen, revoked or stopped repeats a call only with the
key it had (docs/worker.md, "Durable runs"); a call made again in doubt is counted as a
repeat, which is allowed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """POSTs on 127.0.0.1: (key, body) of each, in arrival order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        lock = threading.Lock()
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                if length == 0 or len(raw) < length:
                    return  # cut off mid-request (its worker killed): it never arrived, nothing acted
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
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="chaos-receiver", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()

    def keys_by_call(self) -> dict[str, set[str]]:
        calls: dict[str, set[str]] = defaultdict(set)
        for key, body in list(self.seen):
            calls[body].add(key)
        return calls


def script(host: str) -> dict:
    """The scripted model: the events -> POST their first message; its result -> a reply; done."""
    return {
        "rules": [
            {"when": {"tool_result": "send_message"}, "reply": []},
            {
                "when": {"tool_result": "http_request"},
                "reply": [{"type": "tool_use", "name": "send_message", "input": {"text": "acted", "urgent": True}}],
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


def environment(host: str) -> dict[str, str]:
    """The workers' settings for the acting agent."""
    return {
        "VIGIL_AGENT": "claude",
        "VIGIL_TOOL_PERMISSIONS": "http_request=allow",
        "VIGIL_HTTP_ALLOWED_HOSTS": host,
        "VIGIL_OUTBOUND_ALLOWED_NETS": "127.0.0.0/8",
    }
