"""Issue 58: every port vigil listens on, in each service's own process, over a real socket.

One set of processes for the module (ingest, the console, a worker, the scheduler, the
dispatcher, each ``python -m vigil <service>``), probed with raw HTTP/1.1: a request with no
``Host`` or with two gets ingest's 400 JSON answer on every port, and the console's own 408
(a body slower than its read timeout) and a client that hangs up mid-body are neither a
traceback nor a counted 500. After each probe, the probed process's log holds no traceback
and no ERROR line, and its /metrics counts no 5xx.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import VigilProcess, wait_for
from test_security_http import json_body, read_answer
from vigil.ops.config import SETTINGS_CLASSES
from vigil.settings import settings_rows
from vigil_dev.devstack import free_port

SERVICES = ("ingest", "console", "worker", "scheduler", "dispatcher")
CONSOLE_BODY_TIMEOUT_S = 2

# The settings that name a port to listen on, by service: every one is probed.
PORTS = {
    service: [
        row["variable"]
        for row in settings_rows(SETTINGS_CLASSES)
        if row["variable"].endswith("_PORT") and row["services"] == service
    ]
    for service in SERVICES
}

# What each port serves: every one its health routes, a route that does not exist, and the
# API ports one route that reads a body.
PATHS = {
    "VIGIL_INGEST_PORT": [b"GET /healthz", b"GET /metrics", b"GET /nope", b"POST /v1/events"],
    "VIGIL_CONSOLE_PORT": [b"GET /healthz", b"GET /metrics", b"GET /nope", b"POST /login"],
}
HEALTH_PATHS = [b"GET /healthz", b"GET /readyz", b"GET /metrics", b"GET /nope"]
HOSTS = {"no Host": [], "two Hosts": [b"127.0.0.1", b"evil.test"], "the same Host twice": [b"a", b"a"]}


class Running:
    """The module's processes, each with the ports its settings name."""

    def __init__(self, processes: dict[str, VigilProcess], ports: dict[str, dict[str, int]]):
        self.processes = processes
        self.ports = ports  # service -> setting -> port
        self.offsets = {name: 0 for name in processes}

    def mark(self) -> None:
        """Where each log stands now: :meth:`assert_clean` reads only what comes after."""
        self.offsets = {name: len(proc.log()) for name, proc in self.processes.items()}

    def assert_clean(self, service: str) -> None:
        """No traceback, no ERROR line in the service's log since :meth:`mark`, and no 5xx
        counted on any of its ports."""
        written = self.processes[service].log()[self.offsets[service] :]
        bad = [line for line in written.splitlines() if is_error_line(line)]
        assert bad == [], f"vigil {service} logged:\n" + "\n".join(bad)
        for port in self.ports[service].values():
            assert fives(port) == [], (service, port)


def is_error_line(line: str) -> bool:
    if "Traceback" in line:
        return True
    try:
        record = json.loads(line)
    except ValueError:
        return " ERROR " in f" {line} " or line.startswith("ERROR")  # a line before vigil's logging
    return isinstance(record, dict) and record.get("level") in ("ERROR", "CRITICAL")


def fives(port: int) -> list[str]:
    """Every sample on the port's /metrics that counts a 5xx answer."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return [
        f"{sample.name}{sample.labels} {sample.value}"
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("status", "").startswith("5") and sample.value > 0
    ]


# One worker runs the module: its five processes start once (make suite runs --dist loadgroup).
pytestmark = pytest.mark.xdist_group("every_port")


@pytest.fixture(scope="module")
def running(module_stack) -> Running:
    env, spawn = module_stack
    env = {
        **env,
        "VIGIL_CONSOLE_PORT": str(free_port()),
        "VIGIL_CONSOLE_BODY_TIMEOUT_S": str(CONSOLE_BODY_TIMEOUT_S),
        "VIGIL_AGENT": "echo",  # the worker needs no model to listen
    }
    ports = {service: {name: int(env[name]) for name in PORTS[service]} for service in SERVICES}
    processes = {service: spawn([service], env, name=service) for service in SERVICES}
    for service, proc in processes.items():
        proc.wait_healthy(next(iter(ports[service].values())), timeout=60)
    running = Running(processes, ports)
    running.mark()
    return running


def test_every_service_listens_only_on_the_ports_its_settings_name(running):
    """The probe below covers every port: none a service opens that its settings do not name."""
    for service, proc in running.processes.items():
        assert running.ports[service], f"{service} has no port setting"
        listening = {
            c.laddr.port for c in psutil.Process(proc.pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
        }
        assert listening == set(running.ports[service].values()), (service, listening, running.ports[service])


def raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        return read_answer(sock, timeout=10)


def request_of(line: bytes, hosts: list[bytes]) -> bytes:
    # Connection: close, so that the answer ends when the server closes, not at its keep-alive.
    head = line + b" HTTP/1.1\r\nConnection: close\r\n" + b"".join(b"Host: " + h + b"\r\n" for h in hosts)
    if line.startswith(b"POST"):
        return head + b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    return head + b"\r\n"


@pytest.mark.parametrize("hosts", HOSTS.values(), ids=HOSTS.keys())
@pytest.mark.parametrize("service", SERVICES)
def test_a_missing_or_doubled_host_is_ingests_400_on_every_port(running, service, hosts):
    """Issue 58: every port but ingest's accepted a request with no Host or two."""
    running.mark()
    ingest = running.ports["ingest"]["VIGIL_INGEST_PORT"]
    expected = json_body(raw(ingest, request_of(b"GET /healthz", hosts)))
    assert (expected["error"], expected["field"]) == ("invalid_request", "Host"), expected
    for setting, port in running.ports[service].items():
        for line in PATHS.get(setting, HEALTH_PATHS):
            answer = raw(port, request_of(line, hosts))
            assert answer.startswith(b"HTTP/1.1 400 "), (setting, line, answer[:300])
            assert b"\r\ncontent-type: application/json\r\n" in answer.split(b"\r\n\r\n")[0].lower() + b"\r\n", answer
            assert json_body(answer) == expected, (setting, line, answer[:300])
        control = raw(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert control.startswith(b"HTTP/1.1 200 "), (setting, control[:300])
        old = raw(port, b"GET /healthz HTTP/1.0\r\n\r\n")  # HTTP/1.0 has no Host to require
        assert old.startswith(b"HTTP/1.1 200 "), (setting, old[:300])
    running.assert_clean(service)


def logins_counted(running: Running) -> dict[str, float]:
    """The console's answers to POST /login so far, by status."""
    port = running.ports["console"]["VIGIL_CONSOLE_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vigil_console_requests_total"
        and (sample.labels["route"], sample.labels["method"]) == ("/login", "POST")
    }


def assert_a_disconnect(running: Running, before: dict[str, float]) -> None:
    """Once the login has returned (its answer counted): nothing logged, no 5xx counted, and
    the answer counted is the disconnect's 400."""
    wait_for(lambda: sum(logins_counted(running).values()) > sum(before.values()), 10, "the login's answer counted")
    running.assert_clean("console")
    assert logins_counted(running).get("400", 0) == before.get("400", 0) + 1


LOGIN_HEAD = (
    b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
    b"Content-Length: 100\r\n\r\ntoken=vgl_"
)


def test_the_consoles_408_on_a_slow_body_is_no_traceback_and_no_500(running):
    """Issue 58: the console's own 408 (its body timeout) logged a traceback and counted a 500."""
    running.mark()
    before = logins_counted(running)
    with socket.create_connection(("127.0.0.1", running.ports["console"]["VIGIL_CONSOLE_PORT"])) as sock:
        started = time.monotonic()
        sock.sendall(LOGIN_HEAD)
        answer = read_answer(sock, timeout=CONSOLE_BODY_TIMEOUT_S + 10)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert json_body(answer)["error"] == "request_timeout", answer
    assert time.monotonic() - started < CONSOLE_BODY_TIMEOUT_S + 5
    assert_a_disconnect(running, before)


def test_a_console_client_that_hangs_up_mid_body_is_no_traceback_and_no_500(running):
    """Issue 58: a login whose client went away mid-body logged a ClientDisconnect traceback
    and counted a 500 (tests/test_console_sessions.py checks the application in process;
    this, the served port)."""
    running.mark()
    before = logins_counted(running)
    sock = socket.create_connection(("127.0.0.1", running.ports["console"]["VIGIL_CONSOLE_PORT"]))
    sock.sendall(LOGIN_HEAD)
    time.sleep(0.3)  # the login is reading its body
    sock.close()
    assert_a_disconnect(running, before)


@pytest.mark.parametrize("service", SERVICES)
def test_no_route_and_a_wrong_method_have_ingests_codes_on_every_port(running, service):
    """Issue 58: the console's 405 (and its form-limit 400) said not_found; the health ports
    answered plain text."""
    running.mark()
    for port in running.ports[service].values():
        for line, status, code in (
            (b"GET /nope", b"404", "not_found"),
            (b"POST /healthz", b"405", "method_not_allowed"),
        ):
            answer = raw(port, request_of(line, [b"127.0.0.1"]))
            assert answer.startswith(b"HTTP/1.1 " + status + b" "), (service, line, answer[:300])
            assert json_body(answer)["error"] == code, (service, line, answer[:300])
    if service == "console":
        fields = b"&".join(b"f%d=1" % i for i in range(1500))
        form = (
            b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n" % len(fields)
        )
        answer = raw(running.ports["console"]["VIGIL_CONSOLE_PORT"], form + fields)
        assert answer.startswith(b"HTTP/1.1 400 ") and json_body(answer)["error"] == "invalid_request", answer[:300]
    running.assert_clean(service)
