"""An MCP server for the tests, on the official SDK (MCPServer, formerly FastMCP).

``python mcp_test_server.py stdio LOG`` or ``python mcp_test_server.py http PORT LOG``: every
tool call appends one JSON line to LOG (the tool, its arguments, the request's ``_meta``), so
the test sees what arrived.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("orders", version="2.0.1")
LOG = sys.argv[-1]


def record(ctx: Context, tool: str, **args: object) -> None:
    meta = dict(ctx.request_context.meta or {})
    params = ctx.session.client_params
    client = f"{params.client_info.name} {params.client_info.version}" if params else None
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "args": args, "meta": meta, "client": client}, default=str) + "\n")


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def lookup(order_id: str, ctx: Context) -> str:
    """Where an order is."""
    record(ctx, "lookup", order_id=order_id)
    return f"order {order_id} shipped"


@server.tool(annotations=ToolAnnotations(destructive_hint=True))
def cancel_order(order_id: str, ctx: Context) -> str:
    """Cancel an order."""
    record(ctx, "cancel_order", order_id=order_id)
    return f"order {order_id} cancelled"


@server.tool()
def big(ctx: Context) -> str:
    """A very long answer."""
    record(ctx, "big")
    return "x" * 100_000


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def slow(ctx: Context) -> str:
    """Answers after ten seconds."""
    record(ctx, "slow")
    time.sleep(10)
    return "late"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def whereami(ctx: Context) -> str:
    """The server's working directory and its ORDERS_REGION variable."""
    record(ctx, "whereami")
    return f"cwd={os.getcwd()} region={os.environ.get('ORDERS_REGION')} home={os.environ.get('HOME')}"


@server.tool()
def crash_once(ctx: Context) -> str:
    """Dies in the middle of its first call (a marker file beside LOG remembers it did)."""
    record(ctx, "crash_once")
    marker = Path(LOG + ".crashed")
    if not marker.exists():
        marker.touch()
        os._exit(1)
    return "done"


if __name__ == "__main__":
    # Two lines on stderr at start, as servers log: the worker labels each with the server's name.
    print("orders: starting\norders: ready for calls", file=sys.stderr, flush=True)
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
