"""Dispatcher processes: SIGKILL between the send and the commit, and two replicas over one
outbox. Real `vigil dispatcher` processes, a real receiver, time moved through a clock file."""

from __future__ import annotations

import signal
import time
from collections import defaultdict
from datetime import timedelta

import pytest

from dispatcher_support import (
    PASS_METRIC,
    T0,
    Receiver,
    add_message,
    add_messages,
    add_webhook_users,
    metric,
    standard_webhooks_valid,
)
from support import query, scalar, wait_for
from vigil.clock import write_clock_file


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def clock_file(tmp_path):
    path = tmp_path / "clock"
    write_clock_file(path, T0.timestamp())
    return path


def dispatcher_env(vigil_env, clock_file, **extra) -> dict[str, str]:
    return {
        **vigil_env,
        "VIGIL_DISPATCHER_CLOCK_FILE": str(clock_file),
        "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.05",
        "VIGIL_OUTBOX_GAP": "3600",
        **extra,
    }


def passes_after(ports: list[int], moment: float, timeout: float = 30) -> None:
    """Wait until every dispatcher finished a pass that started after ``moment``: a pass that
    finishes after moment + its own start may have started before, so wait for two."""
    for _ in range(2):

        def passed(moment=moment):
            return all((metric(p, PASS_METRIC) or 0) > moment for p in ports)

        wait_for(passed, timeout, "a full dispatcher pass")
        moment = time.time()


def test_sigkill_after_the_receiver_got_it_before_the_commit_resends_the_same_delivery(
    ledger, vigil_env, spawn, receiver, clock_file
):
    secret = add_webhook_users(ledger, ["ana"], receiver.url)["ana"]
    add_message(ledger, "ana", "one", created_at=T0)
    add_message(ledger, "ana", "two", created_at=T0)
    env = dispatcher_env(vigil_env, clock_file, VIGIL_DELIVERY_LEASE_S="120")
    doomed = spawn(["dispatcher"], {**env, "VIGIL_DISPATCHER_CRASH_AFTER_SEND": "1"}, name="dispatcher-killed")
    wait_for(lambda: not doomed.alive(), 60, "the dispatcher to be killed after the send")
    assert doomed.proc.returncode == -signal.SIGKILL
    first = receiver.got()
    assert len(first) == 1 and first[0].bodies == ["one", "two"]
    rows = query(ledger, "SELECT status, delivery_id::text AS d, attempts FROM outbox ORDER BY id")
    assert rows == [{"status": "sending", "d": first[0].id, "attempts": 1}] * 2, "the send happened, its commit did not"

    port = int(env["VIGIL_DISPATCHER_PORT"])
    restarted = spawn(["dispatcher"], env, name="dispatcher-restarted").wait_healthy(port)
    passes_after([port], time.time())
    assert len(receiver.got()) == 1, "inside the lease the killed dispatcher might still be sending"

    write_clock_file(clock_file, (T0 + timedelta(seconds=121)).timestamp())
    wait_for(lambda: scalar(ledger, "SELECT bool_and(status = 'delivered') FROM outbox"), 30, "the re-send")
    passes_after([port], time.time())
    got = receiver.got()
    assert len(got) == 2
    assert got[1].id == got[0].id, "the same delivery id, so the receiver can drop the copy"
    assert got[1].body == got[0].body, "the same bytes"
    assert all(standard_webhooks_valid(secret, r) for r in got)
    assert got[1].timestamp == int((T0 + timedelta(seconds=121)).timestamp()), "signed at its own attempt time"
    rows = query(ledger, "SELECT status, delivery_id::text AS d, attempts, error FROM outbox ORDER BY id")
    assert rows == [{"status": "delivered", "d": got[0].id, "attempts": 2, "error": None}] * 2
    assert scalar(ledger, "SELECT last_delivery_at FROM users") == T0, "a re-send is not a new delivery for the gap"
    assert metric(port, 'vigil_delivery_retries_total{channel="webhook",reason="lost"}') == 1
    assert restarted.stop() == 0, "SIGTERM: the pass in progress finishes, then a clean exit"


def test_two_dispatchers_over_500_users_never_send_a_row_twice_nor_two_deliveries_inside_a_gap(
    ledger, vigil_env, spawn, receiver, clock_file
):
    users = [f"user-{i:03d}" for i in range(500)]
    secrets = add_webhook_users(ledger, users, receiver.url)
    add_messages(ledger, [(u, f"{u} first", False) for u in users] + [(u, f"{u} second", False) for u in users[::3]])
    env = dispatcher_env(vigil_env, clock_file, VIGIL_DISPATCHER_BATCH_USERS="25", VIGIL_DISPATCHER_CONCURRENCY="8")
    ports = []
    for name in ("a", "b"):
        port_env = {**env, "VIGIL_DISPATCHER_PORT": str(_free_port()), "VIGIL_INSTANCE_ID": f"dispatcher-{name}"}
        ports.append(int(port_env["VIGIL_DISPATCHER_PORT"]))
        spawn(["dispatcher"], port_env, name=f"dispatcher-{name}")
    # More messages while both claim: each joins its user's first delivery or waits a gap.
    for start in range(0, 500, 50):
        add_messages(ledger, [(u, f"{u} later", False) for u in users[start : start + 50]])

    def users_served() -> int:
        return len({r.user for r in receiver.got()})

    wait_for(lambda: users_served() == 500, 90, "a first delivery to every user")
    passes_after(ports, time.time())
    per_user = defaultdict(list)
    for request in receiver.got():
        per_user[request.user].append(request)
    assert {u: len(r) for u, r in per_user.items() if len(r) != 1} == {}, "one delivery per user inside the gap"

    write_clock_file(clock_file, (T0 + timedelta(seconds=3600)).timestamp())
    wait_for(
        lambda: scalar(ledger, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 0,
        90,
        "every row delivered",
    )
    passes_after(ports, time.time())

    got = receiver.got()
    assert len({r.id for r in got}) == len(got), "no delivery sent twice"
    carried = [m["id"] for r in got for m in r.data["messages"]]
    assert len(carried) == len(set(carried)), "no outbox row in two deliveries"
    ledger_rows = {r["id"]: r["d"] for r in query(ledger, "SELECT id, delivery_id::text AS d FROM outbox")}
    assert sorted(carried) == sorted(ledger_rows)
    assert all(ledger_rows[m["id"]] == r.id for r in got for m in r.data["messages"])
    per_user = defaultdict(list)
    for request in got:
        per_user[request.user].append(request.timestamp)
    for user, stamps in per_user.items():
        assert len(stamps) <= 2 and all(b - a >= 3600 for a, b in zip(sorted(stamps), sorted(stamps)[1:])), user
    assert all(standard_webhooks_valid(secrets[r.user], r) for r in got[::25])
    delivered = [metric(p, 'vigil_deliveries_total{channel="webhook",result="delivered"}') or 0 for p in ports]
    assert all(n > 0 for n in delivered) and sum(delivered) == len(got), f"both replicas worked: {delivered}"


def _free_port() -> int:
    from vigil_dev.devstack import free_port

    return free_port()
