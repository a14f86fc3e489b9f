"""Shared by the worker tests: producing test events and running worker processes."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
import uuid
from datetime import UTC, datetime

from confluent_kafka import Producer

from support import query, wait_for
from vigil.bus.codec import EventCodec
from vigil.envelope import Event

CODEC = EventCodec()

# Fast failover for tests: a silent worker loses its partitions after 3 s.
FAST = {
    "VIGIL_KAFKA_SESSION_TIMEOUT_MS": "3000",
    "VIGIL_BACKOFF_BASE_S": "0.2",
    "VIGIL_BACKOFF_CAP_S": "1",
    "VIGIL_BATCH_WINDOW_MS": "100",
    "VIGIL_SCAN_INTERVAL_S": "0.2",
}


def chat(user: str, text: str, source_id: str | None = None) -> Event:
    return Event(
        user_id=user,
        source="chat",
        source_id=source_id or uuid.uuid4().hex,
        kind="chat.message",
        payload=json.dumps({"text": text}),
        received_at=datetime.now(UTC),
    )


def produce(
    bootstrap: str, topic: str, events: list[Event], partition: int | None = None, raw: list[bytes] | None = None
) -> None:
    """Produce with the Java-compatible partitioner, or to an explicit partition (a producer
    with another partitioner, as far as vigil can tell)."""
    producer = Producer({"bootstrap.servers": bootstrap, "partitioner": "murmur2_random", "acks": "all"})
    for event in events:
        kwargs = {} if partition is None else {"partition": partition}
        producer.produce(topic, key=event.user_id.encode(), value=CODEC.encode(event), **kwargs)
    for value in raw or []:
        producer.produce(topic, key=b"garbage", value=value)
    assert producer.flush(30) == 0


def metric(port: int, name: str, labels: str = "") -> float:
    """A counter's value from a process's /metrics (0 when absent)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.e+-]+)$", re.MULTILINE)
    total = 0.0
    for match in pattern.finditer(text):
        if labels in (match.group(1) or ""):
            total += float(match.group(2))
    return total


def statuses(dsn: str) -> dict[str, int]:
    return {r["status"]: r["n"] for r in query(dsn, "SELECT status, count(*) AS n FROM events GROUP BY status")}


def wait_all_done(dsn: str, total: int, timeout: float = 60.0) -> None:
    wait_for(
        lambda: statuses(dsn).get("done", 0) == total,
        timeout,
        f"{total} events done (now {statuses(dsn)})",
        interval=0.2,
    )


def assert_runs_consistent(dsn: str, retried: bool = False) -> None:
    """Every done event in exactly one run; no user had overlapping runs; per-user runs follow event order
    (unless an operator ``retried`` a dead event); each message run has exactly one outbox row."""
    rows = query(
        dsn,
        "SELECT id, user_id, event_ids, started_at, finished_at, outcome, partition"
        " FROM runs ORDER BY user_id, started_at",
    )
    seen: dict[int, int] = {}
    for run in rows:
        for event_id in run["event_ids"]:
            assert event_id not in seen, f"event {event_id} in runs {seen[event_id]} and {run['id']}"
            seen[event_id] = run["id"]
    done = {r["id"] for r in query(dsn, "SELECT id FROM events WHERE status = 'done'")}
    assert done == set(seen), f"done events not in exactly one run: {sorted(done ^ set(seen))[:10]}"
    by_user: dict[str, list] = {}
    for run in rows:
        by_user.setdefault(run["user_id"], []).append(run)
    for user, runs in by_user.items():
        for before, after in zip(runs, runs[1:]):
            assert after["started_at"] >= before["finished_at"], (
                f"{user}: runs {before['id']} and {after['id']} overlap"
            )
            in_order = retried or max(before["event_ids"]) < min(after["event_ids"])
            assert in_order, f"{user}: run {after['id']} took older events"
    counts = query(
        dsn,
        "SELECT r.id, r.outcome, count(o.id) AS n"
        " FROM runs r LEFT JOIN outbox o ON o.run_id = r.id GROUP BY r.id, r.outcome",
    )
    for row in counts:
        expected = 1 if row["outcome"] == "message" else 0
        assert row["n"] == expected, f"run {row['id']} ({row['outcome']}) has {row['n']} outbox rows"


def claude_env(vigil_env: dict[str, str], base_url: str, **extra: str) -> dict[str, str]:
    """A worker running the Claude agent against the scripted Messages API at ``base_url``."""
    return {
        **vigil_env,
        **FAST,
        "VIGIL_AGENT": "claude",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "scripted-test-key",
        "VIGIL_MODEL": "claude-scripted-1",
        **extra,
    }


class Supervisor:
    """Restarts worker processes that die, like a process manager would."""

    def __init__(self, spawn, env_factory, count: int):
        self.spawn, self.env_factory = spawn, env_factory
        self.workers = [self._start(i) for i in range(count)]
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _start(self, index: int):
        return self.spawn(["worker"], self.env_factory(), name=f"w{index}-{time.monotonic_ns()}")

    def _watch(self):
        while not self._stop.wait(0.2):
            for i, proc in enumerate(self.workers):
                if not proc.alive():
                    self.workers[i] = self._start(i)
                    self.restarts += 1

    def stop(self):
        self._stop.set()
        self._thread.join(5)
