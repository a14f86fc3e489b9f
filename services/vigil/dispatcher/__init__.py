"""The dispatcher: relays the outbox to each user's channel, paced per user.

``dead_deliveries(conn, limit)`` is exported for ``vigil dead``; it is loaded on first use
so that importing the CLI does not pull in the channels' HTTP and Kafka clients.
"""

from __future__ import annotations

__all__ = ["dead_deliveries"]


def __getattr__(name: str):
    if name == "dead_deliveries":
        from vigil.dispatcher.operator import dead_deliveries

        return dead_deliveries
    raise AttributeError(f"module 'vigil.dispatcher' has no attribute {name!r}")
