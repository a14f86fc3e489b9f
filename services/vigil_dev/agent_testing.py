"""Builders for driving the Claude agent without a worker: tests and local experiments.

A run needs a :class:`RunContext` the way the worker fills it; these make one from a few
events, and an agent whose SDK client talks to a :class:`ScriptedServer`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from vigil.agent.base import ApprovalRequest, EventRow, RunContext, RunResult, SavedSession
from vigil.agent.claude import ClaudeAgent, model_client
from vigil.agent.settings import AgentSettings

SCRIPTED_MODEL = "claude-scripted-1"
TEST_SECRET = "test-approval-secret"
_ids = itertools.count(1000)


def event(
    kind: str = "chat.message",
    payload: Any = None,
    *,
    source: str = "chat",
    user_id: str = "u1",
    session_id: str | None = None,
    source_id: str | None = None,
) -> EventRow:
    """A claimed event; ``payload`` is JSON-encoded unless it is already a string."""
    event_id = next(_ids)
    return EventRow(
        id=event_id,
        user_id=user_id,
        source=source,
        source_id=source_id or f"{source}-{event_id}",
        kind=kind,
        payload=payload if isinstance(payload, str) else json.dumps(payload if payload is not None else {}),
        session_id=session_id,
        received_at=datetime.now(UTC),
        attempts=1,
    )


def chat(text: str, **kwargs: Any) -> EventRow:
    return event("chat.message", {"text": text}, **kwargs)


def context(
    events: list[EventRow],
    *,
    user_id: str = "u1",
    memory: dict[str, str] | None = None,
    sessions: Sequence[SavedSession] = (),
    approvals: Sequence[ApprovalRequest] = (),
    recent: Sequence[str] = (),
    fold=None,
    seconds: float = 120.0,
) -> RunContext:
    saved = {s.id: s for s in sessions}
    return RunContext(
        user_id=user_id,
        run_key=f"{user_id}:1:{events[0].id if events else 0}:1",
        events=list(events),
        session=next(iter(saved.values()), None),
        memory={} if memory is None else memory,
        recent_messages=list(recent),
        started_at=datetime.now(UTC),
        deadline=time.monotonic() + seconds,
        fold=fold,
        approvals={a.request_id: a.answer for a in approvals if a.answer},
        sessions=saved,
        approval_requests={a.request_id: a for a in approvals},
    )


def settings(**overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {"approval_secret": TEST_SECRET, "model": SCRIPTED_MODEL, "model_backoff_s": 0.01}
    values.update(overrides)
    return AgentSettings(**values)


def agent(base_url: str, agent_settings: AgentSettings | None = None, **overrides: Any) -> ClaudeAgent:
    """A ClaudeAgent whose real SDK client talks to ``base_url``. Build it inside the event loop
    that runs it: the client's connections belong to that loop."""
    agent_settings = agent_settings or settings(**overrides)
    # The worker's own client (transport, pool, limits), pointed at the scripted server.
    client = model_client(agent_settings, base_url=base_url, api_key="scripted-test-key")
    return ClaudeAgent(agent_settings, client=client)


def run(base_url: str, *ctxs: RunContext, **overrides: Any) -> list[RunResult]:
    """Run the contexts one after the other with one agent (built in the loop that runs it)."""

    async def go() -> list[RunResult]:
        claude = agent(base_url, **overrides)
        try:
            return [await claude.run(ctx) for ctx in ctxs]
        finally:
            await claude.close()

    return asyncio.run(go())


def saved(result: RunResult, session_id: str | None = None) -> SavedSession:
    """A session the run saved, as the next run would load it."""
    saves = ([result.session] if result.session else []) + list(result.other_sessions)
    s = next(s for s in saves if session_id is None or s.id == session_id)
    return SavedSession(s.id, s.state, json.loads(json.dumps(s.messages)), s.blocks, s.consecutive_blocks, s.pending)


def apply_memory(memory: dict[str, str], result: RunResult) -> dict[str, str]:
    """The user's files after the worker stored the run's memory writes."""
    out = dict(memory)
    for write in result.memory_writes:
        if write.content is None:
            out.pop(write.path, None)
        else:
            out[write.path] = write.content
    return out
