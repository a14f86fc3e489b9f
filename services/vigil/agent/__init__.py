"""The agent behind a run: ``VIGIL_AGENT`` chooses it (see :mod:`vigil.agent.base`)."""

from __future__ import annotations

from vigil.agent.base import Agent
from vigil.agent.echo import EchoAgent


def make_agent(settings) -> Agent:
    """The worker's agent: ``echo`` (built in, no model) or ``claude``."""
    if settings.agent == "echo":
        return EchoAgent()
    if settings.agent == "claude":
        # Imported here on purpose: the Anthropic SDK takes over a second to import and only
        # VIGIL_AGENT=claude needs it (every other process, `vigil --help` included, would pay).
        from vigil.agent.claude import ClaudeAgent

        return ClaudeAgent.from_environment()
    raise ValueError(f"unknown agent {settings.agent!r}")
