"""What Kubernetes relies on: readiness that answers inside the probe's timeout, a worker
shutdown that fits the pod's termination grace."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from dispatcher_support import add_message, add_users
from support import query, scalar, wait_for
from vigil.health import DatabaseCheck, HealthServer, Readiness, dependency_checks
from vigil.scheduler.pruner import Pruner
from vigil.service import EXIT_LOOP_DIED
from vigil.settings import CommonSettings
from vigil_dev.devstack import free_port
from worker_support import FAST, chat, produce

PROBE_TIMEOUT_S = 1.0  # the manifests' readinessProbe.timeoutSeconds


def test_readyz_answers_within_the_probe_timeout_with_both_dependencies_down():
    """Checks run in the background: a probe never waits for a broker or database timeout."""
    settings = CommonSettings(
        kafka_bootstrap=f"127.0.0.1:{free_port()}", database_url=f"postgresql://vigil@127.0.0.1:{free_port()}/vigil"
    )
    port = free_port()
    server = HealthServer(port, Readiness(dependency_checks(settings)), host="127.0.0.1").start()
    try:
        for _ in range(10):
            started = time.monotonic()
            response = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
            assert time.monotonic() - started < PROBE_TIMEOUT_S, "readyz slower than the probe timeout"
            assert response.status_code == 503
            assert response.json()["checks"] == {"kafka": False, "database": False}
            time.sleep(0.3)
    finally:
        server.stop()


def test_ingest_style_readiness_stays_200_and_reports_each_check():
    settings = CommonSettings(
        kafka_bootstrap=f"127.0.0.1:{free_port()}", database_url=f"postgresql://vigil@127.0.0.1:{free_port()}/vigil"
    )
    readiness = Readiness(dependency_checks(settings), gating=set())
    status = readiness.status()
    assert status == {"kafka": False, "database": False}
    assert readiness.ready(status)
    readiness.set("shutting_down", False)  # a flag a service sets itself always gates
    assert not readiness.ready(readiness.status())


def test_readiness_reuses_one_connection(ledger):
    # Client sessions only: an autovacuum worker on the fresh test database shows in
    # pg_stat_activity too, and is not the check's doing.
    sessions = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'"
    )
    check = DatabaseCheck(ledger)
    assert check()
    backend = check._conn.info.backend_pid
    before = scalar(ledger, sessions)
    for _ in range(20):
        assert check()
    assert scalar(ledger, sessions) == before  # twenty checks, no new sessions
    assert check._conn.info.backend_pid == backend  # and the same one server process
    first = check._conn
    assert check() and check._conn is first


def worker_env(vigil_env, port: int, **extra: str) -> dict[str, str]:
    return {**vigil_env, **FAST, "VIGIL_AGENT": "echo", "VIGIL_WORKER_PORT": str(port), **extra}


def sigterm_while_running(spawn, stack, topics, ledger, env, text: str) -> tuple[int, float]:
    worker = spawn(["worker"], env, name="w").wait_healthy(int(env["VIGIL_WORKER_PORT"]))
    produce(stack.bootstrap, topics.events, [chat("slowpoke", text)])
    wait_for(
        lambda: scalar(ledger, "SELECT status FROM events WHERE user_id = 'slowpoke'") == "running",
        30,
        "the run started",
    )
    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    code = worker.proc.wait(float(env["VIGIL_SHUTDOWN_GRACE_S"]) + 10)
    assert code == 0, worker.log()[-3000:]
    return code, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.partitions(1)
def test_worker_shutdown_ends_within_its_grace_despite_a_long_run(stack, topics, ledger, vigil_env, spawn):
    """A run that would take 45 s must not hold SIGTERM past VIGIL_SHUTDOWN_GRACE_S: it gets
    its share of the grace, then is cancelled and released (back to pending), exit 0."""
    grace = 8.0
    env = worker_env(vigil_env, free_port(), VIGIL_ECHO_SLEEP_ON="glacial:45", VIGIL_SHUTDOWN_GRACE_S=str(grace))
    _, took = sigterm_while_running(spawn, stack, topics, ledger, env, "a glacial request")
    # Within the grace and the interpreter's exit: under the pod's grace (VIGIL_SHUTDOWN_GRACE_S + 10).
    assert took < grace + 3, took
    assert took >= grace / 2 - 0.5, took  # the run had its share (half of 8 s) before it was cancelled
    assert scalar(ledger, "SELECT status FROM events WHERE user_id = 'slowpoke'") == "pending"


@pytest.mark.slow
@pytest.mark.partitions(1)
def test_sigterm_lets_a_short_run_finish_instead_of_redoing_it(stack, topics, ledger, vigil_env, spawn):
    """A run that ends within its share of the grace commits: no cancelled run to do again."""
    env = worker_env(vigil_env, free_port(), VIGIL_ECHO_SLEEP_ON="slow:2", VIGIL_SHUTDOWN_GRACE_S="14")
    _, took = sigterm_while_running(spawn, stack, topics, ledger, env, "a slow request")
    assert took < 14 + 3, took
    row = query(ledger, "SELECT status, attempts FROM events WHERE user_id = 'slowpoke'")[0]
    assert (row["status"], row["attempts"]) == ("done", 1)


# -- a loop that dies takes its process down with a non-zero status -------------------------
# Kubernetes shows a process that exits 0 as Completed, not as an error: a service whose loop
# died of something it does not retry must say so in its exit status.


@pytest.mark.partitions(1)
def test_a_worker_whose_claim_loop_dies_exits_non_zero(stack, topics, ledger, vigil_env, spawn):
    """An event out of attempts is copied to the dead-letter topic by the claim pass, its
    encoder asking the schema registry; a registry that does not answer is nothing the claim
    loop retries (it retries the ledger's errors and the network's), so the loop dies."""
    query(ledger, "INSERT INTO users (user_id, home_topic, home_partition) VALUES ('stuck', %s, 0)", (topics.events,))
    query(
        ledger,
        "INSERT INTO events (user_id, source, source_id, kind, payload, received_at, status, attempts)"
        " VALUES ('stuck', 'chat', 'stuck-1', 'chat.message', '{}', now(), 'pending', 3)",
    )
    env = worker_env(vigil_env, free_port(), VIGIL_SCHEMA_REGISTRY_URL=f"http://127.0.0.1:{free_port()}")
    worker = spawn(["worker"], env, name="w")
    code = worker.proc.wait(90)
    assert code == EXIT_LOOP_DIED, worker.log()[-3000:]
    assert "claim-loop died" in worker.log()
    assert scalar(ledger, "SELECT status FROM events WHERE user_id = 'stuck'") == "dead"


def test_a_dispatcher_whose_loop_dies_exits_non_zero(ledger, vigil_env, spawn):
    """A user whose last delivery is dated in year 9999 (a planted row) holds an urgent
    message past the urgent cap: the moment to look at the user again is past the last date
    Python can hold. Nothing the loop retries (it retries the ledger's errors), so it dies."""
    add_users(ledger, ["far-future"])
    query(ledger, "UPDATE users SET last_delivery_at = '9999-12-31 23:00:00+00'")
    add_message(ledger, "far-future", "urgent, but the cap is used up", urgent=True)
    env = {**vigil_env, "VIGIL_URGENT_DAILY_CAP": "0", "VIGIL_DISPATCHER_POLL_INTERVAL_S": "0.1"}
    dispatcher = spawn(["dispatcher"], env, name="d")
    code = dispatcher.proc.wait(60)
    assert code == EXIT_LOOP_DIED, dispatcher.log()[-3000:]
    assert "delivery loop died" in dispatcher.log()


def test_a_scheduler_whose_pruner_dies_stops_and_says_so(ledger):
    """The scheduler's timer loop retries whatever fails (a pass rolls back whole, the next one
    tries again). Its pruner retries ledger errors at the next interval; anything else used to
    end its thread silently, the scheduler carrying on healthy-looking with no partition made
    ahead. Now it stops the scheduler, and ``serve`` returns ``EXIT_LOOP_DIED`` for it. No row or
    setting makes a prune raise anything but a ledger error, so here the pruner's own callback
    (its metrics) does."""

    def broken_metrics(_counts):
        raise RuntimeError("the counters are gone")

    stopping = threading.Event()
    pruner = Pruner(ledger, 0, stopping, on_pruned=broken_metrics).start()
    assert stopping.wait(30), "the pruner's death did not stop the scheduler"
    pruner.thread.join(5)
    assert not pruner.thread.is_alive()
    assert isinstance(pruner.error, RuntimeError)
