"""What Kubernetes relies on: readiness that answers inside the probe's timeout, a worker
shutdown that fits the pod's termination grace."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from support import scalar, wait_for
from vigil.devstack import free_port
from vigil.health import DatabaseCheck, HealthServer, Readiness, dependency_checks
from vigil.settings import CommonSettings
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
    check = DatabaseCheck(ledger)
    assert check()
    pid = scalar(ledger, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
    for _ in range(20):
        assert check()
    after = scalar(ledger, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
    assert after == pid  # twenty checks, no new sessions
    first = check._conn
    assert check() and check._conn is first


@pytest.mark.slow
@pytest.mark.partitions(1)
def test_worker_shutdown_ends_within_its_grace_despite_a_long_run(stack, topics, ledger, vigil_env, spawn):
    """A run that would take 45 s must not hold SIGTERM past VIGIL_SHUTDOWN_GRACE_S: it is
    cancelled and released (back to pending) and the worker exits 0."""
    grace = 6.0
    port = free_port()
    env = {
        **vigil_env,
        **FAST,
        "VIGIL_AGENT": "echo",
        "VIGIL_WORKER_PORT": str(port),
        "VIGIL_ECHO_SLEEP_ON": "glacial:45",
        "VIGIL_SHUTDOWN_GRACE_S": str(grace),
    }
    worker = spawn(["worker"], env, name="w").wait_healthy(port)
    produce(stack.bootstrap, topics.events, [chat("slowpoke", "a glacial request")])
    wait_for(
        lambda: scalar(ledger, "SELECT status FROM events WHERE user_id = 'slowpoke'") == "running",
        30,
        "the slow run started",
    )
    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    code = worker.proc.wait(grace + 10)
    took = time.monotonic() - started
    assert code == 0, worker.log()[-3000:]
    # The runs' share (grace minus the close reserve) plus the close: within the grace and
    # the interpreter's exit, well under the pod's termination grace (VIGIL_SHUTDOWN_GRACE_S + 5).
    assert took < grace + 3, took
    assert scalar(ledger, "SELECT status FROM events WHERE user_id = 'slowpoke'") == "pending"
