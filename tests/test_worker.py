"""The worker records every event once, batches a user's quick messages, and dead-letters garbage."""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime, timedelta

from confluent_kafka import Consumer

from support import query, scalar, wait_for
from worker_support import FAST, assert_runs_consistent, chat, metric, produce, wait_all_done


def start_worker(spawn, vigil_env, name="worker", **extra):
    env = {**vigil_env, **FAST, "VIGIL_AGENT": "echo", **extra}
    return spawn(["worker"], env, name=name).wait_healthy(int(env["VIGIL_WORKER_PORT"]))


def test_duplicate_delivery_and_redelivery_after_restart_give_one_row(stack, topics, ledger, vigil_env, spawn):
    first = start_worker(spawn, vigil_env, "first")
    webhook = chat("alice", "hello", source_id="gh-delivery-1")
    produce(stack.bootstrap, topics.events, [webhook, webhook])  # the provider retried
    wait_for(lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status = 'done'") == 1, 30, "event done")
    # SIGKILL before the auto-commit interval: the offsets were stored but never committed.
    # The ledger's own position would skip both copies; without it (a ledger that never
    # recorded from the partition, as after an upgrade) the next worker starts at the group's
    # committed offset and reads both copies again.
    first.kill()
    query(ledger, "DELETE FROM consumer_positions")
    second = start_worker(spawn, vigil_env, "second")
    port = int(vigil_env["VIGIL_WORKER_PORT"])
    wait_for(
        lambda: metric(port, "vigil_events_recorded_total", 'result="duplicate"') >= 2, 30, "redelivered copies seen"
    )
    assert scalar(ledger, "SELECT count(*) FROM events WHERE source_id = 'gh-delivery-1'") == 1
    assert scalar(ledger, "SELECT count(*) FROM outbox") == 1
    assert second.alive()
    # The record transaction that found the copies is timed beside the claim and the finish.
    assert metric(port, "vigil_worker_ledger_seconds_count", 'step="record"') >= 1


def test_three_quick_messages_one_run_one_reply(stack, topics, ledger, vigil_env, spawn):
    start_worker(spawn, vigil_env, VIGIL_BATCH_WINDOW_MS="300")
    produce(stack.bootstrap, topics.events, [chat("bob", "one"), chat("bob", "two"), chat("bob", "three")])
    wait_all_done(ledger, 3)
    runs = query(ledger, "SELECT event_ids, outcome FROM runs WHERE user_id = 'bob'")
    assert len(runs) == 1 and len(runs[0]["event_ids"]) == 3
    assert [r["body"] for r in query(ledger, "SELECT body FROM outbox WHERE user_id = 'bob'")] == ["one\ntwo\nthree"]


def test_events_during_a_run_go_to_the_next_run(stack, topics, ledger, vigil_env, spawn):
    start_worker(spawn, vigil_env, VIGIL_ECHO_SLEEP_ON="slow:1.5")
    produce(stack.bootstrap, topics.events, [chat("carol", "slow first")])
    wait_for(
        lambda: scalar(ledger, "SELECT count(*) FROM events WHERE status = 'running'") == 1, 20, "first run started"
    )
    produce(stack.bootstrap, topics.events, [chat("carol", "second"), chat("carol", "third")])
    wait_all_done(ledger, 3)
    runs = query(ledger, "SELECT event_ids FROM runs WHERE user_id = 'carol' ORDER BY id")
    assert [len(r["event_ids"]) for r in runs] == [1, 2]
    assert_runs_consistent(ledger)


def test_a_run_past_its_timeout_is_a_failed_attempt_and_others_go_on(stack, topics, ledger, vigil_env, spawn):
    """VIGIL_RUN_TIMEOUT_S cancels a run that hangs: each attempt fails with TimeoutError, the
    event ends dead after VIGIL_MAX_ATTEMPTS, and another user's run beside it is not held up."""
    start_worker(spawn, vigil_env, VIGIL_ECHO_SLEEP_ON="hang:600", VIGIL_RUN_TIMEOUT_S="1", VIGIL_MAX_ATTEMPTS="2")
    produce(stack.bootstrap, topics.events, [chat("dave", "hang forever"), chat("erin", "quick")])
    wait_for(lambda: scalar(ledger, "SELECT status FROM events WHERE user_id = 'erin'") == "done", 20, "erin done")
    wait_for(lambda: scalar(ledger, "SELECT status FROM events WHERE user_id = 'dave'") == "dead", 30, "dave dead")
    dave = query(ledger, "SELECT attempts, error FROM events WHERE user_id = 'dave'")[0]
    assert dave["attempts"] == 2 and "TimeoutError" in dave["error"], dave
    runs = query(ledger, "SELECT outcome, finished_at - started_at AS took FROM runs WHERE user_id = 'dave'")
    assert [r["outcome"] for r in runs] == ["failed", "failed"], runs
    assert all(r["took"].total_seconds() < 5 for r in runs), runs  # cancelled at 1 s, not after 600


def test_undecodable_bytes_go_to_the_dlq_and_nothing_stops(stack, topics, ledger, vigil_env, spawn):
    worker = start_worker(spawn, vigil_env)
    produce(stack.bootstrap, topics.events, [chat("dave", "before")], raw=[b"not avro at all", b"\xc3\x01garbage"])
    produce(stack.bootstrap, topics.events, [chat("dave", "after")])
    wait_all_done(ledger, 2)
    found = read_dead_letters(stack.bootstrap, topics.dlq, 2)
    assert sorted(m.value() for m in found) == sorted([b"not avro at all", b"\xc3\x01garbage"])
    reasons = [dict(m.headers())["vigil-error"].decode() for m in found]
    assert any("unknown framing" in r for r in reasons) and any("truncated" in r or "fingerprint" in r for r in reasons)
    assert worker.alive()
    assert metric(int(vigil_env["VIGIL_WORKER_PORT"]), "vigil_events_undecodable_total") == 2


def test_events_the_ledger_cannot_take_go_to_the_dlq_and_the_rest_of_their_batch_is_recorded(
    stack, topics, ledger, vigil_env, spawn
):
    """Avro that decodes but is not an event the ledger can take: dead-lettered with the reason,
    alone. A payload nested past Python's recursion limit, and a NUL that PostgreSQL text
    cannot hold (it failed the whole batch's COPY), once stopped the consumer."""
    worker = start_worker(spawn, vigil_env)
    deep = dataclasses.replace(chat("ed", "deep"), payload="[" * 100_000 + "]" * 100_000)
    not_json = dataclasses.replace(chat("ed", "not json"), payload="{not json")
    nul = dataclasses.replace(chat("ed", "nul"), source_id="id\x00")
    traced = dataclasses.replace(chat("ed", "traced"), headers={"traceparent": "00-abc-def-01"})
    produce(stack.bootstrap, topics.events, [chat("ed", "before"), deep, not_json, nul, traced])
    wait_all_done(ledger, 2)
    found = read_dead_letters(stack.bootstrap, topics.dlq, 3)
    reasons = sorted(dict(m.headers())["vigil-error"].decode() for m in found)
    assert len(reasons) == 3 and "NUL" in reasons[0] and all("payload is not JSON" in r for r in reasons[1:])
    assert max(len(m.value()) for m in found) > 200_000
    assert (
        scalar(ledger, "SELECT headers->>'traceparent' FROM events WHERE payload LIKE '%%traced%%'") == "00-abc-def-01"
    )
    assert worker.alive()


def test_events_stamped_outside_1970_to_a_day_ahead_go_to_the_dlq_with_the_field(
    stack, topics, ledger, vigil_env, spawn
):
    """Finding: a producer-set ``received_at`` of year 1 or 9999 was recorded and ordered the
    console's timeline. Produced straight to Kafka (ingest refuses them with a 400), such
    events are dead-lettered with the reason; the rest of their batch is recorded."""
    worker = start_worker(spawn, vigil_env)
    year_1 = datetime(1, 1, 1, tzinfo=UTC)
    year_9999 = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
    ahead = datetime.now(UTC) + timedelta(days=2)
    bad = [
        dataclasses.replace(chat("fay", "old"), received_at=year_1),
        dataclasses.replace(chat("fay", "future"), received_at=year_9999),
        dataclasses.replace(chat("fay", "occurred"), occurred_at=year_1),
        dataclasses.replace(chat("fay", "ahead"), occurred_at=ahead),
    ]
    produce(stack.bootstrap, topics.events, [chat("fay", "before"), *bad, chat("fay", "after")])
    wait_all_done(ledger, 2)
    found = read_dead_letters(stack.bootstrap, topics.dlq, 4)
    reasons = sorted(dict(m.headers())["vigil-error"].decode() for m in found)
    assert reasons == [
        "occurred_at is before 1970-01-01T00:00:00Z",
        "occurred_at is more than a day ahead of now",
        "received_at is before 1970-01-01T00:00:00Z",
        "received_at is more than a day ahead of now",
    ], reasons
    assert scalar(ledger, "SELECT count(*) FROM events") == 2
    assert worker.alive()


def read_dead_letters(bootstrap: str, topic: str, count: int) -> list:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}.check", "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    found = []
    deadline = time.monotonic() + 30
    while len(found) < count and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None and not message.error():
            found.append(message)
    consumer.close()
    return found


def test_bad_setting_is_a_clean_startup_error(spawn, vigil_env):
    proc = spawn(["worker"], {**vigil_env, "VIGIL_MAX_ATTEMPTS": "zero"}, name="bad")
    proc.proc.wait(30)
    assert proc.proc.returncode == 2
    assert "VIGIL_MAX_ATTEMPTS='zero'" in proc.log() and "Traceback" not in proc.log()


def test_claude_agent_without_a_key_is_a_clean_startup_error(spawn, vigil_env):
    env = {**vigil_env, "VIGIL_AGENT": "claude", "ANTHROPIC_API_KEY": "", "ANTHROPIC_AUTH_TOKEN": ""}
    proc = spawn(["worker"], env, name="nokey")
    proc.proc.wait(30)
    assert proc.proc.returncode == 2
    assert "ANTHROPIC_API_KEY" in proc.log() and "Traceback" not in proc.log()
