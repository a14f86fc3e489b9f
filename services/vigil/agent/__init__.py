"""The agent behind a run: ``VIGIL_AGENT`` chooses it (see :mod:`vigil.agent.base`)."""

from __future__ import annotations

from vigil.agent.base import Agent


def make_agent(settings) -> Agent:
    """The worker's agent: ``echo`` (built in, no model) or ``claude``."""
    if settings.agent == "echo":
        from vigil.agent.echo import EchoAgent

        return EchoAgent()
    if settings.agent == "claude":
        from vigil.agent.claude import ClaudeAgent  # type: ignore[import-not-found]

        return ClaudeAgent.from_environment()
    raise ValueError(f"unknown agent {settings.agent!r}")
