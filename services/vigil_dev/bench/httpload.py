"""A small HTTP/1.1 load generator: N keep-alive connections, each sending the next request
as soon as the previous response is complete, for a fixed time.

Written for the bench rather than taken from a general client because the client must cost
far less than the server it measures on a 2-core machine: requests are prebuilt bytes (only
a counter is formatted in), responses are parsed just enough to find their end and status,
on uvloop. It supports exactly what ingest answers: ``Content-Length`` bodies, no chunking.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency of ingest
    uvloop = None


@dataclass
class Result:
    seconds: float
    by_status: dict[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return sum(n for status, n in self.by_status.items() if 200 <= status < 300)

    @property
    def refused(self) -> int:
        return sum(n for status, n in self.by_status.items() if not 200 <= status < 300)

    @property
    def ok_per_s(self) -> float:
        return self.ok / self.seconds


def request_bytes(method: str, path: str, host: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Connection(asyncio.Protocol):
    def __init__(self, next_request: Callable[[], bytes], deadline: float, result: Result, done: asyncio.Future):
        self.next_request = next_request
        self.deadline = deadline
        self.result = result
        self.done = done
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.next_request())

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : stop if stop >= 0 else len(head)])
            total = end + 4 + length
            if len(self.buffer) < total:
                return
            status = int(head[9:12])
            self.result.by_status[status] = self.result.by_status.get(status, 0) + 1
            del self.buffer[:total]
            if time.monotonic() >= self.deadline:
                self.transport.close()
                return
            self.transport.write(self.next_request())

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(exc)


async def _run(host: str, port: int, concurrency: int, seconds: float, next_request: Callable[[], bytes]) -> Result:
    loop = asyncio.get_running_loop()
    result = Result(seconds)
    started = time.monotonic()
    deadline = started + seconds
    waiters = []
    for _ in range(concurrency):
        done = loop.create_future()
        await loop.create_connection(lambda d=done: _Connection(next_request, deadline, result, d), host, port)  # type: ignore[misc]
        waiters.append(done)
    await asyncio.wait_for(asyncio.gather(*waiters), seconds + 60)
    result.seconds = time.monotonic() - started
    return result


def run(host: str, port: int, concurrency: int, seconds: float, next_request: Callable[[], bytes]) -> Result:
    """Drive the server for ``seconds``; every connection finishes its request in flight."""
    if uvloop is not None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_run(host, port, concurrency, seconds, next_request))
    return asyncio.run(_run(host, port, concurrency, seconds, next_request))
