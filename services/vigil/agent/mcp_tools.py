"""Tools from MCP servers (``VIGIL_MCP_SERVERS``), through the official ``mcp`` client.

Each server's tools are listed once at start-up and offered to the model as
``<server>__<tool>`` with the server's input schema; each becomes an :class:`McpTool`, an
ordinary action tool, so permissions, approvals, the journal and idempotency keys work as
for any other. Default permission: ``allow`` for a tool annotated read-only
(``readOnlyHint``), ``ask`` for every other (the MCP spec's default for a tool without
annotations is "may be destructive"). In ``auto`` mode a tool not marked non-destructive
(``destructiveHint: false``) is blocked.

Transports:

- streamable HTTP (``url``): a connection per call, through the outbound address policy
  (``VIGIL_OUTBOUND_ALLOWED_NETS``, checked again at connect time against DNS rebinding),
  with the named credential's header (``VIGIL_CREDENTIAL_<NAME>``);
- stdio (``command``): a process each worker starts on first use and keeps; one that dies
  or stops answering is dropped and started again by the next call.

Every call carries the run's idempotency key in the request's ``_meta``
(``idempotency_key``), is bounded by ``VIGIL_MCP_TIMEOUT_S``, and its result is cut at
``VIGIL_MCP_MAX_RESULT_BYTES``. A server that is down, slow or refused is an error result
the model reads, never a failed run. A server that cannot be listed at start-up is logged
and offers no tools while it is down: the worker lists it again every ``VIGIL_MCP_RETRY_S``
(:func:`list_again`) and offers its tools from the first listing that succeeds. A server
listed once keeps its tools (the list is part of the cached prompt prefix): a tool added
to it later appears after a restart.

The handshake: the SDK probes ``server/discover`` (MCP 2026-07-28) and falls back to the
``initialize`` handshake when the server answers with an error. A server that fell back
(one built on ``mcp`` 1.x, which also writes a long validation warning to its stderr) is
reached with the handshake from then on: one probe per worker, and what the server wrote
during it goes to the log at DEBUG under one INFO line saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from importlib.metadata import version as distribution_version
from typing import Any, TextIO
from urllib.parse import urlsplit

import anyio
import httpx2
import mcp_types
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from vigil import tracing
from vigil.agent import metrics
from vigil.agent.settings import MCP_SEPARATOR, AgentSettings, Credential, McpServer, Permission
from vigil.agent.tools import ActionTool, CallContext, ToolOutput
from vigil.errors import VigilError
from vigil.outbound import AddressPolicy, BlockedAddress, address_policy, guarded_async_transport2, url_problem
from vigil.settings import SettingsError

log = logging.getLogger(__name__)

IDEMPOTENCY_META = "idempotency_key"
MAX_NAME = 64  # the Messages API's limit on a tool name
CALL_SENT = {"mcp.method.name": "tools/call"}  # a sent call's span (GenAI conventions' MCP attribute)
# Starting a stdio server (often an interpreter importing an SDK) takes seconds on a busy
# machine: that is not the tool's time, so it has its own bound beside VIGIL_MCP_TIMEOUT_S.
START_TIMEOUT_S = 30.0
# A server's last stderr lines are added to the reason it failed: a traceback's last line,
# with the few before it that say where.
STDERR_TAIL_LINES = 5
# How long a failed listing waits for the server's stderr to reach its end (the process is
# stopped by then; only a grandchild holding the pipe makes this wait run out).
STDERR_DRAIN_S = 1.0
# How vigil introduces itself in the MCP handshake (clientInfo): servers log it.
CLIENT_INFO = mcp_types.Implementation(name="vigil", version=distribution_version("vigil"))


class ServerDown(VigilError):
    """The server could not be reached, refused by policy, or did not answer in time."""


class _Lost(VigilError):
    """The connection failed before an answer came (the server closed it, or died)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Connection:
    """One MCP server as this worker reaches it."""

    def __init__(self, spec: McpServer, settings: AgentSettings, policy: AddressPolicy):
        self.spec = spec
        self.timeout = settings.mcp_timeout_s
        self.policy = policy
        self.credential: Credential | None = settings.credentials.get(spec.credential) if spec.credential else None
        self._client: Client | None = None  # stdio: the kept session
        self._closing: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)  # stdio: its last lines
        self._stderr_reader: threading.Thread | None = None
        # "auto": probe server/discover, fall back to the initialize handshake; "legacy" once
        # the server fell back (it does not know server/discover: no probe again).
        self.mode = "auto"
        self._settle: Callable[[bool], None] | None = None  # stdio: ends the handshake's stderr hold

    @property
    def address(self) -> str:
        """What a span names as the server: its URL's host, or its command."""
        if self.spec.url:
            return urlsplit(self.spec.url).hostname or self.spec.url
        return self.spec.command or ""

    def _transport(self) -> AbstractAsyncContextManager[Any]:
        spec = self.spec
        if spec.command is not None:
            return self._stdio()
        assert spec.url is not None
        headers = {self.credential.header: self.credential.header_value()} if self.credential else {}
        http = httpx2.AsyncClient(
            headers=headers,
            transport=guarded_async_transport2(self.policy),
            timeout=httpx2.Timeout(self.timeout),
        )
        return streamable_http_client(spec.url, http_client=http)

    @asynccontextmanager
    async def _stdio(self) -> AsyncIterator[Any]:
        """The stdio transport, the process's stderr read line by line into the log.

        What the server writes before the handshake is settled is held (:meth:`_connected`):
        our copy of the pipe's write end stays open until then, to put a mark behind it. A
        pipe keeps order, so every line the server wrote before its answer to the handshake
        is ahead of the mark. Once our copy is closed the reader ends when the process does;
        a spawn or a handshake that fails closes it too, and what was held is logged."""
        spec = self.spec
        params = StdioServerParameters(
            command=spec.command or "", args=list(spec.args), env=dict(spec.env), cwd=spec.cwd
        )
        read_fd, write_fd = os.pipe()
        errlog = os.fdopen(write_fd, "w")
        mark = secrets.token_hex(16)  # no line of the server's starts with it
        reader = threading.Thread(
            target=self._forward_stderr,
            args=(os.fdopen(read_fd, errors="replace"), mark),
            daemon=True,
            name="mcp-stderr",
        )
        reader.start()
        self._stderr_reader = reader

        def settle(fell_back: bool) -> None:
            if not errlog.closed:
                errlog.write(f"\n{mark} {'fell-back' if fell_back else 'settled'}\n")
                errlog.close()

        self._settle = settle
        try:
            async with stdio_client(params, errlog=errlog) as streams:
                yield streams
        finally:
            if self._settle is settle:
                self._settle = None
            errlog.close()
            # What the server wrote is in the log when its connection is over (the process is
            # stopped: only a grandchild holding the pipe makes this wait run out).
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(reader.join, STDERR_DRAIN_S)

    def _forward_stderr(self, pipe: TextIO, mark: str) -> None:
        """Each line the server writes to stderr, as one log line labelled with its name; those
        of the handshake held until :meth:`_connected` marks it settled: at DEBUG if the
        server fell back to the initialize handshake (they are its complaint about the probe)."""
        held: list[str] | None = []
        with pipe:
            for raw in pipe:
                line = raw.rstrip("\r\n")
                if held is not None and line.startswith(mark):
                    self._log_stderr(held, logging.DEBUG if line.endswith("fell-back") else logging.INFO)
                    held = None
                    continue
                if not line.strip():
                    continue
                self.stderr_tail.append(line)
                if held is not None:
                    held.append(line)
                else:
                    self._log_stderr([line], logging.INFO)
        if held:  # the process ended before the handshake did: as it wrote them
            self._log_stderr(held, logging.INFO)

    def _log_stderr(self, lines: list[str], level: int) -> None:
        for line in lines:
            log.log(
                level,
                "MCP server %s: %s",
                self.spec.name,
                line,
                extra={"event": "mcp_stderr", "mcp_server": self.spec.name},
            )

    def _connected(self, client: Client) -> None:
        """The handshake is done: a server that answered ``server/discover`` with an error and
        fell back to ``initialize`` is not probed again."""
        fell_back = self.mode == "auto" and client.session.initialize_result is not None
        if fell_back:
            self.mode = "legacy"
            log.info(
                "MCP server %s does not know server/discover (older than MCP 2026-07-28): reached with the "
                "initialize handshake from now on",
                self.spec.name,
                extra={"mcp_server": self.spec.name},
            )
        if self._settle is not None:
            self._settle(fell_back)

    async def _stderr_note(self) -> str:
        """The server's last stderr lines, for the reason it failed ('' if it wrote none)."""
        reader = self._stderr_reader
        if reader is not None:
            await asyncio.to_thread(reader.join, STDERR_DRAIN_S)
        if not self.stderr_tail:
            return ""
        return "; its stderr ended: " + " | ".join(self.stderr_tail)

    def _new_client(self) -> Client:
        # cache=None: a tool call must reach the server every time.
        return Client(
            self._transport(), read_timeout_seconds=self.timeout, cache=None, client_info=CLIENT_INFO, mode=self.mode
        )

    async def _check_address(self) -> None:
        url = self.spec.url
        if url is None:
            return
        problem = url_problem(url)
        if problem is not None:
            raise ServerDown(problem)
        parts = urlsplit(url)
        assert parts.hostname is not None
        try:
            await self.policy.resolve_async(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        except BlockedAddress as exc:
            raise ServerDown(f"refused by the outbound address policy: {exc}") from None
        except OSError as exc:
            raise ServerDown(str(exc)) from None

    async def list_tools(self) -> tuple[list[mcp_types.Tool], str]:
        """The server's tools and its version (as it reports itself)."""
        await self._check_address()
        bound = max(self.timeout, START_TIMEOUT_S)
        try:
            with anyio.fail_after(bound):
                async with self._new_client() as client:
                    self._connected(client)
                    version = client.server_info.version if client.server_info else ""
                    tools: list[mcp_types.Tool] = []
                    cursor = None
                    while True:
                        page = await client.list_tools(cursor=cursor)
                        tools += page.tools
                        cursor = page.next_cursor
                        if not cursor:
                            return tools, version
        except TimeoutError:
            raise ServerDown(f"not listed within {bound:g} s{await self._stderr_note()}") from None
        except Exception as exc:  # the SDK's errors are many: say which, and what the server said
            raise ServerDown(f"{_reason(exc)}{await self._stderr_note()}") from None

    async def call(self, tool: str, args: dict[str, Any], key: str) -> mcp_types.CallToolResult:
        """One tools/call with the idempotency key in ``_meta``; ServerDown for any failure to get
        an answer (the tool's own errors come back as a result with ``is_error``)."""
        await self._check_address()
        try:
            result = await self._call_once(tool, args, key)
        except _Lost as lost:
            if self.spec.command is None:
                raise ServerDown(lost.reason) from None
            # A kept stdio process that died (crashed, killed, restarted by its package) is
            # started again and asked once more, with the same key: a server that acted
            # before it died drops the second request by the key.
            log.warning("MCP server %s: %s; starting it again for one more try", self.spec.name, lost.reason)
            try:
                result = await self._call_once(tool, args, key)
            except _Lost as again:
                raise ServerDown(again.reason) from None
        metrics.MCP_SERVER_UP.labels(self.spec.name).set(1)
        return result

    async def _call_once(self, tool: str, args: dict[str, Any], key: str) -> mcp_types.CallToolResult:
        """One attempt; _Lost when the connection failed (not a timeout: a call still running
        on the server is not sent again)."""
        meta: Any = {IDEMPOTENCY_META: key}
        try:
            if self.spec.command is not None:
                with anyio.fail_after(START_TIMEOUT_S):
                    client = await self._kept()
                with anyio.fail_after(self.timeout):
                    return await client.call_tool(tool, args, meta=meta)
            with anyio.fail_after(self.timeout):
                async with self._new_client() as client:
                    self._connected(client)
                    return await client.call_tool(tool, args, meta=meta)
        except ServerDown:
            raise
        except TimeoutError:
            self._drop()
            raise ServerDown(f"no answer within {self.timeout:g} s") from None
        except Exception as exc:  # the SDK's errors are many: any of them means no answer
            self._drop()
            metrics.MCP_SERVER_UP.labels(self.spec.name).set(0)
            raise _Lost(f"{_reason(exc)}{await self._stderr_note()}") from None

    async def _kept(self) -> Client:
        """The stdio session this worker keeps, started on first use (and after a failure).
        One task owns it, so that its task groups are entered and left by the same task."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None:
                return self._client
            ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            asyncio.get_running_loop().create_task(self._hold(ready, self._closing))
            self._client = await ready
            return self._client

    async def _hold(self, ready: asyncio.Future[Client], closing: asyncio.Event) -> None:
        try:
            async with self._new_client() as client:
                self._connected(client)
                ready.set_result(client)
                await closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else ServerDown("cancelled"))
            elif not isinstance(exc, Exception):
                raise

    def _drop(self) -> None:
        """Forget the kept session (its process is stopped); the next call starts a new one."""
        if self._closing is not None:
            self._closing.set()
        self._client, self._closing = None, None

    async def close(self) -> None:
        self._drop()


class McpTool(ActionTool):
    """A tool of an MCP server, offered as ``<server>__<tool>``."""

    def __init__(self, connection: Connection, tool: mcp_types.Tool, max_result_bytes: int):
        self.connection = connection
        self.remote_name = tool.name
        self.name = f"{connection.spec.name}{MCP_SEPARATOR}{tool.name}"  # type: ignore[misc]  # per instance
        self.server = connection.spec.name
        self.description = tool.description or f"{tool.name} (MCP server {connection.spec.name})"
        self.input_schema = tool.input_schema
        hints = tool.annotations
        self.read_only = bool(hints and hints.read_only_hint)
        self.destructive = not (hints and (hints.read_only_hint or hints.destructive_hint is False))
        self.default_permission = Permission.ALLOW if self.read_only else Permission.ASK  # type: ignore[misc]
        self.max_result_bytes = max_result_bytes

    def span_attributes(self) -> dict[str, str]:
        # mcp.server.name is vigil's: the conventions name the method and tool, not the server.
        # mcp.method.name is set by run(), only on a call that is sent (not a blocked or deferred one).
        attributes = {
            "gen_ai.tool.type": "extension",
            "mcp.server.name": self.connection.spec.name,
            "mcp.tool.name": self.remote_name,
        }
        if self.connection.spec.url:
            attributes["server.address"] = self.connection.address
        return attributes

    def risk(self, args: dict[str, Any]) -> str | None:
        if self.destructive:
            return f"{self.name} is not marked non-destructive by its MCP server"
        return None

    async def run(self, args: dict[str, Any], call: CallContext) -> ToolOutput:
        tracing.set_current(CALL_SENT)  # on the execute_tool span: this call goes to the server
        try:
            result = await self.connection.call(self.remote_name, args, call.idempotency_key)
        except ServerDown as exc:
            log.warning("MCP server %s: %s", self.server, exc)
            return ToolOutput(f"Not run: the MCP server {self.server} did not answer: {exc}. Try later.", True)
        return ToolOutput(bounded(render(result), self.max_result_bytes), result.is_error)


def render(result: mcp_types.CallToolResult) -> str:
    parts = []
    for block in result.content:
        if isinstance(block, mcp_types.TextContent):
            parts.append(block.text)
        else:
            parts.append(f"[{block.type} content omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts) or "(no content)"


def bounded(text: str, limit: int) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[:limit].decode(errors="ignore") + f"\n[cut: the result was {len(raw)} bytes, {limit} shown]"


def _check_credential_host(spec: McpServer, credential: Credential | None) -> None:
    if credential is None or not credential.hosts or spec.url is None:
        return
    parts = urlsplit(spec.url)
    host = (parts.hostname or "").lower()
    if host not in credential.hosts and f"{host}:{parts.port}" not in credential.hosts:
        raise SettingsError(
            f"VIGIL_MCP_SERVERS: {spec.name}'s host {host} is not in VIGIL_CREDENTIAL_{credential.name.upper()}_HOSTS"
        )


def _run_in_thread(coro: Any) -> Any:
    """Run ``coro`` to completion on a loop of its own: start-up may be inside the worker's loop."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="mcp-list-tools")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _list_all(connections: list[Connection]) -> list[tuple[list[mcp_types.Tool], str] | BaseException]:
    return await asyncio.gather(*(c.list_tools() for c in connections), return_exceptions=True)


def _reason(exc: BaseException) -> str:
    """Why a listing failed, for the log: the SDK wraps a process that exits at once in task
    groups, whose own message says nothing; the first error inside them does."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, ServerDown):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _connections(settings: AgentSettings, names: list[str]) -> list[Connection]:
    policy = address_policy(settings)
    connections = [Connection(settings.servers[name], settings, policy) for name in names]
    for connection in connections:
        _check_credential_host(connection.spec, connection.credential)
    return connections


def _tools_of(
    connections: list[Connection],
    listings: list[tuple[list[mcp_types.Tool], str] | BaseException],
    max_result_bytes: int,
) -> tuple[list[tuple[McpTool, str]], dict[str, str]]:
    found: list[tuple[McpTool, str]] = []
    failed: dict[str, str] = {}
    for connection, listed in zip(connections, listings):
        name = connection.spec.name
        if isinstance(listed, BaseException):
            failed[name] = _reason(listed)
            metrics.MCP_SERVER_UP.labels(name).set(0)
            metrics.MCP_SERVER_TOOLS.labels(name).set(0)
            continue
        tools, version = listed
        metrics.MCP_SERVER_UP.labels(name).set(1)
        metrics.MCP_SERVER_TOOLS.labels(name).set(len(tools))
        for tool in sorted(tools, key=lambda t: t.name):
            if len(name) + len(MCP_SEPARATOR) + len(tool.name) > MAX_NAME:
                log.warning("MCP server %s: tool %s skipped, its prefixed name is over %d", name, tool.name, MAX_NAME)
                continue
            found.append((McpTool(connection, tool, max_result_bytes), version))
    return found, failed


def server_tools(settings: AgentSettings) -> tuple[list[tuple[McpTool, str]], dict[str, str]]:
    """The tools of every server of ``VIGIL_MCP_SERVERS``, listed now (in parallel), each with
    its server's version; and why each server that could not be listed offers none (yet)."""
    if not settings.servers:
        return [], {}
    connections = _connections(settings, list(settings.servers))
    found, failed = _tools_of(connections, _run_in_thread(_list_all(connections)), settings.mcp_max_result_bytes)
    for name, reason in failed.items():
        log.warning("MCP server %s offers no tools until it can be listed: %s", name, reason)
    return found, failed


async def list_again(settings: AgentSettings, names: list[str]) -> tuple[list[tuple[McpTool, str]], dict[str, str]]:
    """:func:`server_tools` for the servers ``names`` (down so far), on the caller's loop."""
    connections = _connections(settings, names)
    return _tools_of(connections, await _list_all(connections), settings.mcp_max_result_bytes)
