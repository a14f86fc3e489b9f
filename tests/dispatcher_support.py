"""Test helpers for the dispatcher: a real HTTP receiver, a Standard Webhooks verifier
written from the spec (not from the dispatcher's code), and ledger rows as the worker's
fenced finish writes them."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler

import psycopg

from support import LocalHTTPServer

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)  # a Monday morning, far from midnight
# A finished sweep's start: everything due then has been claimed, sent and recorded.
PASS_METRIC = "vigil_dispatcher_last_sweep_timestamp_seconds"


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def document(self) -> dict:
        return json.loads(self.body)

    @property
    def data(self) -> dict:
        return self.document["data"]

    @property
    def user(self) -> str:
        return self.data["user_id"]

    @property
    def bodies(self) -> list[str]:
        return [m["body"] for m in self.data["messages"]]

    @property
    def timestamp(self) -> int:
        return int(self.headers["webhook-timestamp"])


def standard_webhooks_valid(secret: str, received: Received) -> bool:
    """The receiver's check, from the Standard Webhooks spec: HMAC-SHA256 keyed with the
    base64 part of the ``whsec_`` secret, over ``{webhook-id}.{webhook-timestamp}.{body}``,
    base64; the header lists space-separated ``v1,<signature>`` entries."""
    key = base64.b64decode(secret.split("_", 1)[1])
    signed = f"{received.headers['webhook-id']}.{received.headers['webhook-timestamp']}.".encode() + received.body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    offered = [part.split(",", 1) for part in received.headers["webhook-signature"].split(" ")]
    return any(version == "v1" and hmac.compare_digest(sig, expected) for version, sig in offered)


@dataclass
class Receiver:
    """An HTTP server on 127.0.0.1 recording every request. ``answer(request)`` returns
    ``(status, headers)``; the default accepts everything."""

    answer: Callable[[Received], tuple[int, dict[str, str]]] = lambda _r: (200, {})
    requests: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                with receiver.lock:
                    receiver.requests.append(request)
                status, headers = receiver.answer(request)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_args):
                return

        self.server = LocalHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def got(self) -> list[Received]:
        with self.lock:
            return list(self.requests)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- ledger rows ------------------------------------------------------------------------


def add_users(dsn: str, users: list[str]) -> None:
    """``users`` rows as the worker records them on a user's first event."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO users (user_id, home_topic, home_partition)"
            " SELECT u, 'test.events', 0 FROM unnest(%s::text[]) u",
            (users,),
        )


def add_messages(dsn: str, messages: list[tuple[str, str, bool]], created_at: datetime | None = None) -> list[int]:
    """Outbox rows ``(user, body, urgent)`` as a run's fenced finish writes them: one runs row
    per user (the outbox's foreign key), epoch 1, all in one transaction. Returns the outbox
    ids in the order given."""
    with psycopg.connect(dsn) as conn:
        users = sorted({user for user, _, _ in messages})
        runs = dict(
            conn.execute(
                "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids,"
                " started_at, finished_at, outcome)"
                " SELECT u, 'test.events', 0, 1, 'test', '{}', now(), now(), 'message' FROM unnest(%s::text[]) u"
                " RETURNING user_id, id",
                (users,),
            ).fetchall()
        )
        rows = conn.execute(
            "INSERT INTO outbox (user_id, run_id, epoch, body, urgent, created_at)"
            " SELECT u, r, 1, b, g, coalesce(%s, now())"
            " FROM unnest(%s::text[], %s::bigint[], %s::text[], %s::boolean[]) WITH ORDINALITY AS m(u, r, b, g, n)"
            " ORDER BY n RETURNING id",
            (
                created_at,
                [m[0] for m in messages],
                [runs[m[0]] for m in messages],
                [m[1] for m in messages],
                [m[2] for m in messages],
            ),
        ).fetchall()
    return [r[0] for r in rows]


def add_message(dsn: str, user: str, body: str, urgent: bool = False, created_at: datetime | None = None) -> int:
    return add_messages(dsn, [(user, body, urgent)], created_at)[0]


def add_webhook_users(dsn: str, users: list[str], url: str, gap: int | None = None) -> dict[str, str]:
    """Users with a webhook channel each (their own secret); returns user -> secret."""
    from vigil.dispatcher.channels import new_secret

    add_users(dsn, users)
    secrets = {user: new_secret() for user in users}
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO channels (user_id, type, url, secret, gap_seconds)"
            " SELECT u, 'webhook', %s, s, %s FROM unnest(%s::text[], %s::text[]) AS t(u, s)",
            (url, gap, list(secrets), list(secrets.values())),
        )
    return secrets


def in_process_dispatcher(dsn: str, clock, log_stream=None, **overrides):
    """A dispatcher in this process on the test's ledger, driven pass by pass with ``clock``."""
    from vigil.bus.kafka import EventProducer
    from vigil.dispatcher.channels import Channels, KafkaChannel, LogChannel, WebhookChannel
    from vigil.dispatcher.loop import Dispatcher
    from vigil.dispatcher.settings import DispatcherSettings
    from vigil.outbound import address_policy

    settings = DispatcherSettings(database_url=dsn, **{"delivery_http_timeout_s": 2.0, **overrides})
    channels = Channels(
        WebhookChannel(settings.delivery_http_timeout_s, settings.dispatcher_concurrency, address_policy(settings)),
        KafkaChannel(settings.deliveries_topic, lambda: EventProducer(settings)),
        LogChannel(log_stream),
    )
    return Dispatcher(settings, clock, channels)


def one_pass(d) -> int:
    """One claim, its sends and their outcomes, driven through the dispatcher's parts (the
    loop overlaps these; a test wants them one after the other). Returns the deliveries
    attempted. First what earlier sends could not record; then a claim of the sweep's next
    users (wrapping to the first user), the sends, and every outcome recorded as it arrives.
    A ledger error while recording is raised once every send has finished: their outcomes
    wait in the recorder for the reconnect, as in the loop."""
    d.recorder.settle_left_over()
    claimed, closed_sweep = d.chooser.claim_due(d.limits.batch_users, sweep=True)
    d.sender.start(claimed.deliveries, closed_sweep)
    failed: psycopg.Error | None = None
    while d.sender.in_flight:
        d.sender.collect(None)
        if failed is None:
            try:
                d.recorder.settle()
                d.sender.finish_passes()
            except psycopg.Error as exc:
                failed = exc  # the other sends still finish
    if failed is not None:
        raise failed
    d.sender.finish_passes()
    return len(claimed.deliveries)


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """A metric's current value in this process (0 if never set)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def metric(port: int, name: str) -> float | None:
    """A metric summed over its label sets, scraped from a dispatcher process's /metrics."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    return sum(values) if values else None
