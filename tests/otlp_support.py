"""An OTLP/HTTP receiver in the test's process: what a tracing backend is sent, decoded with
opentelemetry-proto (tests/test_traces.py and the ``otlp`` fixture in conftest.py)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Status as PbStatus

from support import LocalHTTPServer

# A span's status code as OTLP sends it.
UNSET, ERROR = PbStatus.STATUS_CODE_UNSET, PbStatus.STATUS_CODE_ERROR


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    links: tuple[str, ...]
    start: int  # unix nanoseconds
    end: int = 0
    status: int = UNSET
    attributes: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class OtlpReceiver:
    """POST /v1/traces (OTLP/HTTP, protobuf) on 127.0.0.1; keeps every span it is sent."""

    def __init__(self):
        self.spans: list[Span] = []
        # The exporting side's flush (its BatchSpanProcessor's), where the test holds it.
        self.flush: Callable[[], object] = lambda: None
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = LocalHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    found.append(
                        Span(
                            service=attributes.get("service.name", "?"),
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            links=tuple(link.span_id.hex() for link in s.links),
                            start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano,
                            status=s.status.code,
                            attributes={a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(found)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, name: str) -> list[Span]:
        """The spans called ``name``, in the order they started."""
        with self.lock:
            return sorted((s for s in self.spans if s.name == name), key=lambda s: s.start)

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
