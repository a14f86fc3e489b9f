"""What-if replay: a kept run run again against a changed agent, nothing executed
(docs/agent.md, "Changing an agent safely").

A kept run (a finished run's journal, ``VIGIL_RUN_JOURNAL_DAYS`` > 0) is run again by the
real agent loop in the caller's process, with:

- the run's recorded events, "now" and system prompt (its profile's part swapped when the
  replay runs another profile version or prompt);
- the model asked anew, every turn (the client ``ANTHROPIC_*`` configures);
- action calls served from the journal: a call the recorded run made (same tool, same
  arguments) gets its recorded outcome; a call it did not make is not executed, and the
  model reads that it was not. No tool's ``run`` is ever reached: :class:`WhatIfJournal`
  never calls ``execute``.
- no writer and no ledger: messages, follow-ups, memory edits, approval requests and
  background tasks stay in the returned result, which nothing commits.

Both runs come back as :class:`Side` (turns, the calls of each and what became of them,
messages the user would have received, tokens) for printing side by side.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from vigil.agent.base import EventRow, RunContext
from vigil.agent.claude import DEADLINE_MARGIN_S, ClaudeAgent, with_profile_prompt
from vigil.agent.conversation import Toolbox
from vigil.agent.journal import Journal
from vigil.agent.memory import MemoryFiles
from vigil.agent.profiles import Profile
from vigil.agent.settings import AgentSettings
from vigil.agent.tools import BUILTIN, SEND_MESSAGE, ToolOutput

NOT_EXECUTED = (
    "Not executed: this is a what-if replay of a recorded run, and the recorded run made no such call, "
    "so there is no recorded outcome to give."
)

# What became of a call. Recorded side: RECORDED. Replay side: the others.
RECORDED = "recorded"
SERVED = "served"  # the recorded run made this call: its recorded outcome was given
NEW = "new"  # the recorded run did not: not executed
BUILTIN_CALL = "builtin"  # messages, follow-ups, memory: the run's result, which nothing commits
NOT_RUN = "not run"  # refused before it could run (permission, arguments, safety, approval)


@dataclass
class Call:
    name: str
    input: Any
    became: str

    def view(self) -> dict[str, Any]:
        return {"tool": self.name, "input": self.input, "became": self.became}


@dataclass
class Turn:
    """One model answer: its text, the calls it made, its tokens (input counts cached ones)."""

    text: str
    calls: list[Call]
    input_tokens: int
    output_tokens: int

    @classmethod
    def of(cls, content: list[dict[str, Any]], usage: Any, became: str) -> Turn:
        u = usage if isinstance(usage, dict) else vars(usage)
        calls = [
            Call(b["name"], b.get("input"), BUILTIN_CALL if b["name"] in BUILTIN and became != RECORDED else became)
            for b in content
            if b.get("type") == "tool_use"
        ]
        text = " ".join(b.get("text", "") for b in content if b.get("type") == "text").strip()
        tokens_in = sum(
            u.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )
        return cls(text, calls, tokens_in, u.get("output_tokens") or 0)


@dataclass
class Side:
    """One run as the comparison reads it."""

    label: str  # what it ran with: profile, version, model
    turns: list[Turn]

    @property
    def calls(self) -> list[Call]:
        return [c for t in self.turns for c in t.calls]

    @property
    def actions(self) -> list[tuple[str, str]]:
        """The action calls (every tool but the builtins), in order, arguments canonical."""
        return [(c.name, _canonical(c.input)) for c in self.calls if c.name not in BUILTIN]

    @property
    def messages(self) -> list[str]:
        """What the user would have received (send_message texts, in order)."""
        return [
            str(c.input.get("text", "")).strip()
            for c in self.calls
            if c.name == SEND_MESSAGE and isinstance(c.input, dict)
        ]

    @property
    def tokens(self) -> tuple[int, int]:
        return sum(t.input_tokens for t in self.turns), sum(t.output_tokens for t in self.turns)

    def view(self) -> dict[str, Any]:
        return {
            "ran_with": self.label,
            "turns": [
                {
                    "text": t.text,
                    "calls": [c.view() for c in t.calls],
                    "input_tokens": t.input_tokens,
                    "output_tokens": t.output_tokens,
                }
                for t in self.turns
            ],
            "messages": self.messages,
            "tokens": dict(zip(("input", "output"), self.tokens, strict=True)),
        }


# Verdicts of a replay, one each: the canary's rows.
SAME, DIFFERENT, NEW_ACTIONS = "same actions", "different actions", "new actions"


@dataclass
class Replay:
    run_key: str
    recorded: Side
    replay: Side

    @property
    def verdict(self) -> str:
        """``new actions`` if the replay made a call the recorded run did not; else
        ``different actions`` if its action calls differ (one dropped, reordered); else ``same actions``."""
        if any(c.became == NEW for c in self.replay.calls):
            return NEW_ACTIONS
        return SAME if self.recorded.actions == self.replay.actions else DIFFERENT

    @property
    def messages_changed(self) -> bool:
        return self.recorded.messages != self.replay.messages

    def view(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "verdict": self.verdict,
            "messages_changed": self.messages_changed,
            "recorded": self.recorded.view(),
            "replay": self.replay.view(),
        }


@dataclass(frozen=True)
class Kept:
    """A kept run as the replay reads it: its journal's steps (``step``, ``kind``, ``body``,
    ``outcome`` as stored JSON text, in order), the events its start names, the user's memory."""

    run_key: str
    user_id: str
    steps: Sequence[Any]
    events: list[EventRow]
    memory: dict[str, str]

    @property
    def start(self) -> dict[str, Any]:
        first = self.steps[0] if self.steps else None
        start = json.loads(first.body).get("start") if first is not None and first.kind == "model" else None
        if start is None:
            raise ValueError(f"{self.run_key}: its journal has no start (step 1 is not a model answer)")
        return start

    @property
    def profile(self) -> tuple[str, int] | None:
        recorded = self.start.get("profile")
        return (recorded[0], recorded[1]) if recorded else None

    def taken(self) -> list[tuple[int, str, dict[str, Any], dict[str, Any] | None]]:
        """The steps the run took, in order, as (step, kind, body, outcome): steps a replay
        left (from a ``diverged_at`` to its continuation) are not the run's."""
        steps = [(s.step, s.kind, json.loads(s.body), json.loads(s.outcome) if s.outcome else None) for s in self.steps]
        left: set[int] = set()
        for n, _kind, body, _outcome in steps:
            at = body.get("diverged_at")
            if at is not None:
                left |= set(range(at, n))
        return [s for s in steps if s[0] not in left]

    def side(self) -> Side:
        label = _label(self.profile, self.start.get("model"))
        return Side(
            label,
            [
                Turn.of(body["content"], body.get("usage") or {}, RECORDED)
                for _, kind, body, _ in self.taken()
                if kind == "model"
            ],
        )


@dataclass
class WhatIfJournal(Journal):
    """A journal that asks the model every turn, writes nowhere, and never executes a call:
    an action call gets the recorded outcome of the same call (tool and arguments) the
    recorded run made, each recorded call given once; any other is not executed."""

    recorded_start: dict[str, Any] | None = None
    outcomes: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (tool, canonical args, outcome)
    turns: list[Turn] = field(default_factory=list)

    @property
    def start(self) -> dict[str, Any] | None:
        return self.recorded_start

    async def model_turn(
        self, ask: Callable[[], Awaitable[Any]], start: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], Any, bool]:
        content, usage, replayed = await super().model_turn(ask, start)
        self.turns.append(Turn.of(content, usage, NOT_RUN))
        return content, usage, replayed

    async def action(
        self, step: int, name: str, args: dict[str, Any], execute: Callable[[str], Awaitable[ToolOutput]]
    ) -> ToolOutput:
        canonical = _canonical(args)
        found = next((i for i, (n, a, _) in enumerate(self.outcomes) if (n, a) == (name, canonical)), None)
        self._mark(name, canonical, SERVED if found is not None else NEW)
        if found is None:
            return ToolOutput(NOT_EXECUTED, True)
        outcome = self.outcomes.pop(found)[2]
        return ToolOutput(outcome["text"], bool(outcome.get("is_error")))

    def _mark(self, name: str, canonical: str, became: str) -> None:
        """What became of the latest call of ``name`` with these arguments not yet decided."""
        for turn in reversed(self.turns):
            for call in turn.calls:
                if call.became == NOT_RUN and call.name == name and _canonical(call.input) == canonical:
                    call.became = became
                    return


class WhatIfAgent(ClaudeAgent):
    """The Claude agent replaying kept runs (one at a time or several at once): each with the
    profile version it is given, the model and system prompt the replay asks for."""

    def __init__(
        self,
        settings: AgentSettings,
        *,
        model: str | None = None,
        prompt: str | None = None,
        client: Any = None,
    ) -> None:
        super().__init__(settings, client)
        self.model, self.prompt = model, prompt
        self._runs: dict[str, Profile | None] = {}  # run key -> the version it replays with

    async def _run_profile(self, ctx: RunContext, start: dict | None) -> Profile | None:
        return self._runs[ctx.run_key]

    @staticmethod
    def _recorded_model(box: Toolbox, start: dict[str, Any]) -> Toolbox:
        return box  # the replay asks the model of the version under test (or --model)

    async def _count_version_change(
        self, ctx: RunContext, start: dict[str, Any], box: Toolbox, profile: Profile | None
    ) -> None:
        return None  # a what-if replay is not a worker's replay

    def box_for(self, profile: Profile | None) -> Toolbox:
        box = super().box_for(profile)
        return replace(box, settings=box.settings.model_copy(update={"model": self.model})) if self.model else box

    def _opening(
        self, ctx: RunContext, start: dict | None, memory: MemoryFiles, box: Toolbox, profile: Profile | None
    ) -> tuple[datetime, list[dict[str, Any]]]:
        """The recorded "now" and system prompt; its profile's part swapped when the replay
        runs with another version than the recorded one (the base class's), or another prompt."""
        assert start is not None  # a kept run's
        now, system = super()._opening(ctx, start, memory, box, profile)
        recorded = tuple(start["profile"]) if start.get("profile") else None
        if self.prompt is not None:
            return now, with_profile_prompt(system, self.prompt)
        if (recorded is None) != (profile is None):  # to or from the default profile
            return now, with_profile_prompt(system, profile.spec.system_prompt if profile else None)
        return now, system

    async def replay(self, kept: Kept, profile: Profile | None) -> Replay:
        """``kept`` run again with ``profile`` (None: the deployment's settings)."""
        taken = kept.taken()
        outcomes = [(b["name"], _canonical(b.get("input")), o) for _, kind, b, o in taken if kind == "call" and o]
        journal = WhatIfJournal(kept.run_key, recorded_start=kept.start, outcomes=outcomes)
        settings = self.box_for(profile).settings
        ctx = RunContext(
            user_id=kept.user_id,
            run_key=kept.run_key,
            events=kept.events,
            session=None,
            memory=dict(kept.memory),
            recent_messages=[],
            started_at=datetime.fromisoformat(kept.start["now"]),
            deadline=time.monotonic() + settings.run_wall_s + DEADLINE_MARGIN_S,
            journal=journal,
        )
        self._runs[kept.run_key] = profile
        try:
            await self.run(ctx)
        finally:
            del self._runs[kept.run_key]
        label = _label((profile.name, profile.version) if profile else None, settings.model)
        return Replay(kept.run_key, kept.side(), Side(label, journal.turns))


def _label(profile: tuple[str, int] | None, model: str | None) -> str:
    name = f"profile {profile[0]} v{profile[1]}" if profile else "default profile"
    return f"{name}, model {model or '(not recorded)'}"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
