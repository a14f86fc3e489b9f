"""A TCP relay between a worker and PostgreSQL that counts round trips and can add latency.

The cost counters (:mod:`vigil_dev.bench.costs`) say what an event and a run cost in CPU,
rows and WAL; on one machine the database is 0.05 ms away and round trips are nearly free.
A deployment's database is across a network (0.2-1 ms per round trip in one cloud zone), and
the claim loop, the finisher and the recorder each wait out their round trips in series. This
relay measures them: a *round trip* is a turn of a connection, bytes from the client after
bytes from the server (or first), so pipelined statements sent together count once and a
request spanning several segments counts once. ``delay_ms`` holds every chunk that long in
each direction (a round trip then takes twice that more), in order. :meth:`PgProxy.pause`
holds every byte of every connection, open or new, until :meth:`PgProxy.resume` (a database
that stopped answering while its connections stay open).

It runs on its own event loop in a thread of the bench process; the worker's DSN names its
port instead of the server's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg

CHUNK = 1 << 16


class PgProxy:
    """``with PgProxy(dsn, delay_ms) as proxy``: ``proxy.dsn`` reaches ``dsn``'s server through
    the relay; ``proxy.round_trips()`` is its count so far (of every connection, open or closed)."""

    def __init__(self, dsn: str, delay_ms: float = 0.0) -> None:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        self._target = (str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432))
        self._base = dsn
        self.delay_s = delay_ms / 1000.0
        self._round_trips = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pgproxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._flowing = threading.Event()
        self._flowing.set()
        self.port = 0

    @property
    def dsn(self) -> str:
        return psycopg.conninfo.make_conninfo(self._base, host="127.0.0.1", port=str(self.port))

    def round_trips(self) -> int:
        with self._lock:
            return self._round_trips

    def pause(self) -> None:
        """Hold every byte in both directions (connections stay open) until :meth:`resume`."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def __enter__(self) -> PgProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        async def close() -> None:
            self._server.close()
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._relay, "127.0.0.1", 0)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self._target)
        last = ["down"]  # who sent last: a client chunk after a server one starts a round trip
        try:
            await asyncio.gather(
                self._pump(client_r, server_w, "up", last), self._pump(server_r, client_w, "down", last)
            )
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # the relay closing: ended, not failed (asyncio's streams log a cancelled handler)
        finally:
            for writer in (client_w, server_w):
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str, last: list) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                while not self._flowing.is_set():
                    await asyncio.sleep(0.01)
                writer.write(data)
                await writer.drain()
            writer.write_eof() if writer.can_write_eof() else writer.close()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await reader.read(CHUNK):
                with self._lock:
                    if way == "up" and last[0] == "down":
                        self._round_trips += 1
                    last[0] = way
                queue.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            queue.put_nowait(None)
            await delivering
