"""Log lines: one JSON object per line with the fields an operator filters on."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from vigil import logs


@pytest.fixture
def captured():
    stream = io.StringIO()
    yield stream
    logging.basicConfig(force=True, handlers=[logging.NullHandler()])


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_context_and_the_exception_as_one_field(captured):
    logs.setup("INFO", "json", service="worker", stream=captured)
    log = logging.getLogger("vigil.worker.test")
    with logs.context(user_id="alice", partition=3, epoch=7):
        log.info("took %s", "it", extra={"event_id": 42})
        try:
            raise ValueError("bad\nvalue")
        except ValueError:
            log.exception("run failed")
    log.warning("outside")
    first, second, third = lines(captured)
    assert first["service"] == "worker" and first["level"] == "INFO" and first["msg"] == "took it"
    assert (first["user_id"], first["event_id"], first["partition"], first["epoch"]) == ("alice", 42, 3, 7)
    assert second["level"] == "ERROR" and "ValueError: bad\nvalue" in second["exc"]
    assert "user_id" not in third and third["logger"] == "vigil.worker.test"
    assert len(captured.getvalue().splitlines()) == 3  # the traceback stayed inside its line


def test_a_line_the_runbooks_name_carries_its_stable_event_name(captured):
    logs.setup("INFO", "json", service="worker", stream=captured)
    log = logging.getLogger("vigil.worker.test")
    log.warning("stale finish refused: epoch %d", 7, extra={"event": "stale_finish", "epoch": 7})
    log.info("an ordinary line")
    named, ordinary = lines(captured)
    assert (named["event"], named["epoch"]) == ("stale_finish", 7)
    assert "event" not in ordinary


def test_http_clients_per_request_lines_are_off(captured):
    logs.setup("DEBUG", "json", service="worker", stream=captured)
    for name in ("httpx", "httpx2", "anthropic"):
        logging.getLogger(name).info("HTTP Request: POST /v1/messages")
        logging.getLogger(name).warning("a real problem")
    assert [r["msg"] for r in lines(captured)] == ["a real problem"] * 3


def test_text_format_for_a_terminal(captured):
    logs.setup("INFO", "text", service="ingest", stream=captured)
    logging.getLogger("vigil.ingest").info("hello")
    assert captured.getvalue().rstrip().endswith("INFO ingest vigil.ingest: hello")


def test_ingest_lines_name_the_trace_of_an_incoming_traceparent(captured):
    import asyncio

    from vigil.ingest.metrics import RequestMetrics

    logs.setup("INFO", "json", service="ingest", stream=captured)

    async def app(scope, receive, send):
        logging.getLogger("vigil.ingest.test").info("handling")
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message):
        return None

    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    for headers in ([(b"traceparent", f"00-{trace}-00f067aa0ba902b7-01".encode())], [(b"traceparent", b"junk")], []):
        asyncio.run(RequestMetrics(app)({"type": "http", "method": "POST", "headers": headers}, None, send))
    first, second, third = lines(captured)
    assert first["trace_id"] == trace and "trace_id" not in second and "trace_id" not in third


def test_a_broker_down_writes_its_connection_failures_once_per_window(captured):
    """A real librdkafka consumer whose broker refuses connections retries its bootstrap
    connection every 50 ms: about 60 lines in 3 s without the filter, one with it."""
    import socket
    import time

    from confluent_kafka import Consumer

    from vigil.settings import KAFKA_LOGGER

    logs.setup(stream=captured, service="worker")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    consumer = Consumer({"bootstrap.servers": f"127.0.0.1:{port}", "group.id": "g", "logger": KAFKA_LOGGER})
    consumer.subscribe(["t"])
    try:
        began = time.monotonic()
        while time.monotonic() - began < 3:
            consumer.poll(0.1)
    finally:
        consumer.close()
    failures = [line for line in lines(captured) if "Connection refused" in line["msg"]]
    assert len(failures) == 1, [line["msg"] for line in failures]
    assert failures[0]["logger"] == "vigil.kafka" and failures[0]["level"] == "ERROR"


def test_a_repeated_line_is_let_through_again_after_the_window_with_the_count_left_out():
    clock = [0.0]
    repeats = logs.Repeats(logging.getLogger("vigil.kafka"), 30.0, now=lambda: clock[0], flusher=False)

    def record(text: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("vigil.kafka", level, __file__, 1, "%s [%s] %s", ("FAIL", "c#1", text), None)

    first = record("Connect to 127.0.0.1:9092 failed (after 3ms)")
    assert repeats.filter(first) and first.getMessage().endswith("failed (after 3ms)")
    for n in range(40):
        clock[0] += 0.05
        assert not repeats.filter(record(f"Connect to 127.0.0.1:9092 failed (after {n}ms)"))
    assert repeats.filter(record("Disconnected from 127.0.0.1:9092"))  # another kind
    assert repeats.filter(record("Connect to 127.0.0.1:9092 failed (after 1ms)", logging.WARNING))  # another level
    clock[0] = 31.0
    again = record("Connect to 127.0.0.1:9092 failed (after 9ms)")
    assert repeats.filter(again)
    assert again.getMessage() == (
        "FAIL [c#1] Connect to 127.0.0.1:9092 failed (after 9ms)"
        " (40 more like this since the last one logged (31s ago) were not logged)"
    )
    clock[0] += 1
    assert not repeats.filter(record("Connect to 127.0.0.1:9092 failed (after 2ms)"))
    assert all(repeats.filter(record("Broker state 3", logging.INFO)) for _ in range(3))  # DEBUG/INFO all pass


def test_ingest_writes_one_warning_for_a_run_of_refusals_and_every_debug_line(captured):
    """During a broker outage every request is refused with 503: one warning per 30 s, not
    one per request. 4xx refusals are DEBUG lines, and whoever turned DEBUG on gets each."""
    from vigil.ingest.requests import log as requests_log

    logs.setup(level="DEBUG", stream=captured, service="ingest")
    for n in range(5):
        requests_log.warning("refused with %d %s: %s", 503, "broker_unavailable", f"{n} of 1 not acknowledged")
        requests_log.debug("refused with %d %s: %s", 401, "unauthorized", "bad token")
    written = [line for line in lines(captured) if line["logger"] == "vigil.ingest.requests"]
    assert [line["level"] for line in written] == ["WARNING"] + ["DEBUG"] * 5


def test_a_run_of_repeats_that_ends_inside_the_window_is_counted_in_a_line_of_its_own(captured):
    """The broker comes back and librdkafka says nothing more: the count still gets written,
    once the window has passed, and the next line of that kind is written whole."""
    logs.setup(stream=captured, service="worker")
    logger = logging.getLogger("vigil.kafka")
    for installed in [f for f in logger.filters if isinstance(f, logs.Repeats)]:
        logger.removeFilter(installed)  # setup's, on the real clock: this one runs on a fake one
    clock = [0.0]
    repeats = logs.Repeats(logger, 30.0, now=lambda: clock[0], flusher=False)
    logger.addFilter(repeats)
    try:
        for n in range(25):
            logger.error("%s [%s] %s", "FAIL", "consumer-3", f"Connect to 127.0.0.1:{9000 + n} failed")
            clock[0] += 0.05
        repeats.flush()  # inside the window: nothing yet
        assert [line["msg"] for line in lines(captured)] == ["FAIL [consumer-3] Connect to 127.0.0.1:9000 failed"]
        clock[0] = 40.0
        repeats.flush()
        repeats.flush()  # once
        logger.error("%s [%s] %s", "FAIL", "consumer-3", "Connect to 127.0.0.1:9000 failed")
        # A second run: left out, counted with the next line through, which opens a window of
        # its own; what that window leaves out is counted on that line's own text.
        clock[0] += 1
        logger.error("%s [%s] %s", "FAIL", "consumer-3", "Connect to 127.0.0.1:9000 failed")
        clock[0] = 80.0
        logger.error("%s [%s] %s", "FAIL", "consumer-3", "Connect to 127.0.0.1:9001 failed")
        clock[0] += 1
        logger.error("%s [%s] %s", "FAIL", "consumer-3", "Connect to 127.0.0.1:9002 failed")
        clock[0] = 120.0
        repeats.flush()
    finally:
        repeats.stop()
        logger.removeFilter(repeats)
    assert [(line["level"], line["msg"]) for line in lines(captured)] == [
        ("ERROR", "FAIL [consumer-3] Connect to 127.0.0.1:9000 failed"),
        (
            "ERROR",
            "FAIL [consumer-3] Connect to 127.0.0.1:9000 failed"
            " (24 more like this since the last one logged (40s ago) were not logged)",
        ),
        ("ERROR", "FAIL [consumer-3] Connect to 127.0.0.1:9000 failed"),
        (
            "ERROR",
            "FAIL [consumer-3] Connect to 127.0.0.1:9001 failed"
            " (1 more like this since the last one logged (40s ago) were not logged)",
        ),
        (
            "ERROR",
            "FAIL [consumer-3] Connect to 127.0.0.1:9001 failed"
            " (1 more like this since the last one logged (40s ago) were not logged)",
        ),
    ]


def test_the_flusher_thread_writes_the_count_on_its_own(captured):
    import time

    logs.setup(stream=captured, service="ingest")
    logger = logging.getLogger("vigil.ingest.requests")
    for installed in [f for f in logger.filters if isinstance(f, logs.Repeats)]:
        logger.removeFilter(installed)
    repeats = logs.Repeats(logger, 0.2)
    logger.addFilter(repeats)
    try:
        for n in range(10):
            logger.warning("refused with %d %s: %s", 503, "broker_unavailable", f"{n} of 1 not acknowledged")
        deadline = time.monotonic() + 5
        while len(lines(captured)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        repeats.stop()
        logger.removeFilter(repeats)
    written = [line["msg"] for line in lines(captured)]
    assert len(written) == 2, written
    assert re.search(r"\(9 more like this since the last one logged \(\d+s ago\) were not logged\)$", written[1])


def test_the_count_of_a_run_cut_short_by_the_process_stopping_is_written_as_it_exits():
    """A worker stopped (SIGTERM) a few seconds into a broker outage: the failures its
    librdkafka consumer left out of the log are counted in its last lines, not lost with the
    window that had not passed yet."""
    import signal
    import socket
    import subprocess
    import sys
    import textwrap

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    program = textwrap.dedent(
        f"""
        import signal, sys, time
        from confluent_kafka import Consumer
        from vigil import logs
        from vigil.settings import KAFKA_LOGGER
        logs.setup(service="worker")
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
        consumer = Consumer({{"bootstrap.servers": "127.0.0.1:{port}", "group.id": "g", "logger": KAFKA_LOGGER}})
        consumer.subscribe(["t"])
        print("polling", flush=True)
        while not stopping:
            consumer.poll(0.1)
        consumer.close()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "polling"
        import time

        time.sleep(2)  # about 40 refused connections, well inside the 30 s window
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    failures = [json.loads(line)["msg"] for line in err.splitlines() if "Connection refused" in line]
    assert len(failures) == 2, failures
    note = r"\((\d+) more like this since the last one logged \(\d+s ago\) were not logged\)$"
    counted = re.search(note, failures[1])
    assert counted and int(counted.group(1)) >= 10, failures
