"""Log lines: one JSON object per line with the fields an operator filters on."""

from __future__ import annotations

import io
import json
import logging

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
