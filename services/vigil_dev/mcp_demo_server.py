"""The dev stack's MCP server (``vigil-dev up`` names it in ``VIGIL_MCP_SERVERS`` as ``shop``):
one read-only tool, on the official SDK, that the demo's scripted model calls as
``shop__order_status`` (docs/agent.md, "Adding tools").

Started by each worker over stdio: ``python mcp_demo_server.py``. Run as a file, not as a
module, so the process needs only the ``mcp`` package, whatever ``PYTHONPATH`` the worker had
(the SDK's stdio client passes a child only a few variables).
"""

from __future__ import annotations

import zlib

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

server = MCPServer("shop", version="1.0.0")
CARRIERS = ("parcel post", "courier", "freight")


@server.tool(annotations=ToolAnnotations(read_only_hint=True, destructive_hint=False))
def order_status(order_id: str) -> str:
    """Where an order of the demo shop is: its status, carrier and tracking number."""
    # The same answer for the same order every time, so the demo and its tests can name it.
    n = zlib.crc32(order_id.encode())
    return f"order {order_id}: shipped by {CARRIERS[n % len(CARRIERS)]}, tracking VG-{n % 100_000:05d}"


if __name__ == "__main__":
    server.run("stdio")
