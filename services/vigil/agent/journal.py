"""A run's journal as the agent uses it: every step numbered, journaled, and replayed.

A run is a sequence of steps, numbered from 1 in the order the run takes them: each model
turn and each tool call (builtins too, so that the numbering is the same whatever the tools
do), a sync sub-agent's steps being its parent's. The same responses make the same sequence,
so a replay that hands the loop the journaled responses meets every step at the number it
had (:mod:`vigil.ledger.journal` for the ledger's rules).

- **Model turns** (:meth:`Journal.model_turn`): a journaled answer is not requested again; a
  new one is appended before the loop goes on (with the tool results of the turn before it,
  the events folded just before it, and on step 1 the run's start: its events, its "now"
  and its system prompt), so the replayed transcript is the same bytes the model saw.
- **Action calls** (:meth:`Journal.action`): the intent is appended before the tool runs and
  the outcome after. A call with a recorded outcome is not run again (the outcome goes back
  into the transcript); a call in doubt (intent, no outcome) runs again **with the same
  key**, ``<run key>:<step>``.
- Builtins (messages, follow-ups, memory) only change the run's result, which commits with
  the finish: they run again on a replay, and the transcript gets the results journaled.
- A replayed answer or outcome is marked in the trace (``replayed chat``, ``replayed
  execute_tool <tool>``: no call span, no usage; docs/operations.md, "Traces").

The agent never writes to the ledger itself: the worker hands a :class:`Writer` (appends
fenced by the claim's epoch or the task's lease). Without one (an agent driven by a test)
steps are numbered and keyed, and nothing is journaled.

What a claim makes of its user's live journal (fresh, replayed, dropped...) is decided here
too, by one pure function, :func:`decide`, over what the worker found; the worker does the
ledger's side (:func:`vigil.worker.journal.open_run`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import SimpleNamespace
from typing import Any, Protocol

import pydantic_core

from vigil import tracing
from vigil.agent import metrics
from vigil.errors import VigilError
from vigil.ledger.journal import Step

log = logging.getLogger(__name__)


class HandedOver(VigilError):
    """The run stopped at a step boundary because its worker hands it over (a revoke, a
    shutdown): nothing is lost, the next owner replays the journal and goes on from here.

    Not a failure of anything the run was doing: a handler that records failures (a sync
    child's row, :func:`vigil.agent.delegation.run_sync`) lets it through by name first. It
    stays a ``VigilError`` (one exception base) rather than a ``BaseException``: the steps it
    stops are reached only through the run's own code, and those handlers are the ones to hold."""


@dataclass(frozen=True)
class ToolOutput:
    """What a tool call returned: the text the model reads, and whether it is an error. An
    action call's outcome as the journal records it and a replay hands it back."""

    text: str
    is_error: bool = False


class Writer(Protocol):
    """Where a run's steps go (the worker's, fenced): each raises ``Fenced`` when refused."""

    async def append(self, step: int, kind: str, body: str) -> None: ...

    async def outcome(self, step: int, outcome: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Recorded:
    kind: str
    body: dict[str, Any]
    outcome: dict[str, Any] | None


@dataclass
class Journal:
    run_key: str
    writer: Writer | None = None
    recorded: dict[int, Recorded] = field(default_factory=dict)
    step: int = 0  # the last step taken
    # Set by the worker when the run is to be handed over: no new step starts (HandedOver).
    # Journaled steps still replay: they cost nothing.
    stop: Callable[[], bool] | None = None
    _results: list[dict[str, Any]] | None = None  # the last turn's tool results, for the next model step
    _folded: list[int] = field(default_factory=list)  # events folded since the last model step
    _diverged_at: int | None = None  # the step where the replay left the journal, stamped on the next append

    @classmethod
    def of(cls, run_key: str, writer: Writer | None, steps: Sequence[Step] | None = None) -> Journal:
        """``steps``: :class:`vigil.ledger.journal.Step` rows read back (a replay), in order."""
        recorded = {
            s.step: Recorded(s.kind, json.loads(s.body), json.loads(s.outcome) if s.outcome else None)
            for s in steps or []
        }
        return cls(run_key, writer, recorded)

    @property
    def start(self) -> dict[str, Any] | None:
        """The run's start as step 1 journaled it: events, now, system."""
        first = self.recorded.get(1)
        return first.body.get("start") if first is not None and first.kind == "model" else None

    def key(self, step: int) -> str:
        """The idempotency key of step ``step``: the run's identity and the step's position."""
        return f"{self.run_key}:{step}"

    def next_model(self) -> Recorded | None:
        """The journaled model step the run takes next, if it is one (a replayed boundary)."""
        rec = self.recorded.get(self.step + 1)
        return rec if rec is not None and rec.kind == "model" else None

    def replayed_results(self) -> list[dict[str, Any]] | None:
        """The tool results journaled with the next model step (the same bytes as before)."""
        rec = self.next_model()
        return rec.body.get("results") if rec is not None else None

    def folded(self, ids: list[int]) -> None:
        """Events folded in at a live boundary: journaled with the next model step."""
        self._folded += ids

    def results(self, blocks: list[dict[str, Any]]) -> None:
        """A turn's tool results: journaled with the next model step."""
        self._results = blocks

    async def model_turn(
        self, ask: Callable[[], Awaitable[Any]], start: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], Any, bool]:
        """One model step: the journaled answer, or ``ask()``'s appended. Returns (content
        blocks, usage, replayed). ``start`` goes with step 1."""
        self.step += 1
        rec = self.recorded.get(self.step)
        if rec is not None and rec.kind != "model":
            self.step = self._diverge(self.step, "model", None)
            rec = self.recorded.get(self.step)
        if rec is not None:
            usage: Any = SimpleNamespace(**rec.body.get("usage", {}))
            metrics.REPLAYED_STEPS["model"].inc()
            _replayed(self.step, "chat", {})
            tokens = sum(vars(usage).values())
            metrics.REPLAY_SAVED_TOKENS.inc(tokens)
            self._results, self._folded = None, []
            return rec.body["content"], usage, True
        self._boundary()
        started = time.monotonic()
        response = await ask()
        content = assistant_content(response.content)
        u = response.usage
        usage = {
            "input_tokens": u.input_tokens or 0,
            "output_tokens": u.output_tokens or 0,
            "cache_read_input_tokens": getattr(u, "cache_read_input_tokens", None) or 0,
            "cache_creation_input_tokens": getattr(u, "cache_creation_input_tokens", None) or 0,
        }
        body: dict[str, Any] = {"content": content, "usage": usage, "ms": round((time.monotonic() - started) * 1000)}
        if self._results is not None:
            body["results"] = self._results
        if self._folded:
            body["folded"] = self._folded
        if start is not None and self.step == 1:
            body["start"] = start
        self._stamp(body)
        self._results, self._folded = None, []
        if self.writer is not None:
            await self.writer.append(self.step, "model", _dumps(body))
        return content, response.usage, False

    def journaled(self, step: int) -> bool:
        """Whether step ``step`` is in the journal (a replayed call ran before: decided then)."""
        return step in self.recorded

    def fact(self, step: int, name: str) -> ToolOutput | None:
        """The outcome of call ``step`` of ``name`` if the journal holds one: it happened, so
        the replay hands it to the model whatever the agent allows now (a tool since removed,
        denied or set to ask), and never runs it again."""
        rec = self.recorded.get(step)
        if rec is None or rec.kind != "call" or rec.body.get("name") != name or rec.outcome is None:
            return None
        metrics.REPLAYED_STEPS["call"].inc()
        _replayed(step, f"execute_tool {name}", {"gen_ai.tool.name": name})
        return ToolOutput(rec.outcome["text"], bool(rec.outcome.get("is_error")))

    def take(self) -> int:
        """A tool call's step: every call takes one, whatever becomes of it (a builtin's effect
        is the run's result, and a refused call has none: only action calls are journaled)."""
        self.step += 1
        return self.step

    async def action(
        self, step: int, name: str, args: dict[str, Any], execute: Callable[[str], Awaitable[ToolOutput]]
    ) -> ToolOutput:
        """Action call ``step`` (taken with :meth:`take`): the recorded outcome, or
        ``execute(key)`` between its intent and its outcome. A call in doubt executes again
        with the same key."""
        rec = self.recorded.get(step)
        if rec is not None and (rec.kind != "call" or rec.body.get("name") != name):
            step = self.step = self._diverge(step, "call", name)
            rec = self.recorded.get(step)
        key = self.key(step)
        if rec is not None:
            if rec.outcome is not None:
                metrics.REPLAYED_STEPS["call"].inc()
                _replayed(step, f"execute_tool {name}", {"gen_ai.tool.name": name})
                return ToolOutput(rec.outcome["text"], bool(rec.outcome.get("is_error")))
            metrics.REPLAYED_STEPS["in_doubt"].inc()
        else:
            self._boundary()
            intent: dict[str, Any] = {"name": name, "input": args, "key": key}
            self._stamp(intent)
            if self.writer is not None:
                await self.writer.append(step, "call", _dumps(intent))
        output = await execute(key)
        if self.writer is not None:
            await self.writer.outcome(step, _dumps({"text": output.text, "is_error": output.is_error}))
        return output

    def _diverge(self, at: int, kind: str, name: str | None) -> int:
        """The run does not take the journaled step ``at`` (the agent changed between the
        attempts): the number its step takes instead. Steps before ``at`` stay facts; none
        from ``at`` on is replayed, and no key of theirs is given to another call: the run goes
        on live under numbers past every journaled one, the first new step stamped with
        ``diverged_at``. A later replay that diverges at the same step the same way takes up
        that continuation instead of leaving it again."""
        metrics.RUN_REPLAYS.labels("diverged").inc()
        for n in sorted(k for k in self.recorded if k > at):
            rec = self.recorded[n]
            if (
                rec.body.get("diverged_at") == at
                and rec.kind == kind
                and (name is None or rec.body.get("name") == name)
            ):
                log.info("replay of %s left its journal at step %d again: its continuation at %d", self.run_key, at, n)
                return n
        log.warning("replay of %s diverged at step %d: the run goes on live from there", self.run_key, at)
        after = max(self.recorded) + 1
        self.recorded = {k: v for k, v in self.recorded.items() if k < at}
        self._diverged_at = at
        return after

    def _stamp(self, body: dict[str, Any]) -> None:
        if self._diverged_at is not None:
            body["diverged_at"], self._diverged_at = self._diverged_at, None

    def _boundary(self) -> None:
        """Before a new step: stop here if the run is being handed over."""
        if self.stop is not None and self.stop():
            raise HandedOver(f"{self.run_key} handed over before step {self.step}")


def _replayed(step: int, what: str, attributes: dict[str, Any]) -> None:
    """A replayed step's mark in the trace: ``replayed <what>``, no duration, ``vigil.replayed``,
    no ``gen_ai.operation.name`` or ``gen_ai.usage.*`` (no call was made, nothing billed), so
    an LLM observability tool counts no call and no tokens for it."""
    tracing.replayed(f"replayed {what}", {**attributes, "vigil.journal.step": step})


def task_key(task_id: str, lease_epoch: int, *, journaled: bool) -> str:
    """A background task's run key. Journaled: ``task:<id>``, the same for every holder (each
    replays what the ones before did, so a step's key names one call). Not journaled:
    ``task:<id>~<lease epoch>``, a holder's own (a later holder asks the model again and may
    make other calls at the same steps: they must never get a key an earlier call had)."""
    return f"task:{task_id}" if journaled else f"task:{task_id}~{lease_epoch}"


def assistant_content(blocks: list[Any]) -> list[dict[str, Any]]:
    """A response's content as request blocks (only the fields the API accepts back)."""
    out = []
    for block in blocks:
        kind = getattr(block, "type", None)
        if kind == "text":
            if block.text:
                out.append({"type": "text", "text": block.text})
        elif kind == "tool_use":
            out.append({"type": "tool_use", "id": block.id, "name": block.name, "input": dict(block.input)})
        else:  # thinking and other blocks the API wants back verbatim
            out.append(block.model_dump(mode="json", exclude_none=True))
    return out


# -- what a claim makes of its user's live journal ----------------------------------------


class Opening(StrEnum):
    """How a run starts against its user's live journal (``vigil_run_replays_total``'s
    reasons, but ``fresh``). vigil.worker.journal's module doc has the cases in prose."""

    FRESH = "fresh"  # no journal: a new one under the claim's key
    REPLAYED = "replayed"  # the journal's run taken up (this run's, or the run in progress) and replayed
    ALONE = "alone"  # a batch's journal replayed whole on its lead's lone last attempt, uncounted
    ISOLATED = "isolated"  # the batch crashed alone before: journal dropped, the lead runs alone afresh
    STEPPED_BACK = "stepped_back"  # the run in progress is due its lone last attempt: this claim waits
    DISCARDED = "discarded"  # a journal nobody can replay: dropped, the run starts over under a new key


@dataclass(frozen=True, slots=True)
class Found:
    """A user's live journal as the claim found it."""

    run_key: str
    start: tuple[int, ...] | None  # the events its run started with (its step 1); None: no start
    alone: bool = False  # already replayed alone on its lead's last attempt (claim rule 3)
    # Its first event is pending for rule 3's lone last attempt; read only for another run's journal.
    lone_due: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do: ``opening``, under ``run_key``; for a take-up (replayed, alone) the events
    the run must cover (``start``) and what to do instead if they cannot all be claimed."""

    opening: Opening
    run_key: str
    start: tuple[int, ...] = ()
    refused: Decision | None = None

    @property
    def takes_up(self) -> bool:
        return self.opening in (Opening.REPLAYED, Opening.ALONE)

    @property
    def drops_journal(self) -> bool:
        return self.opening in (Opening.ISOLATED, Opening.DISCARDED)


def same_run(journal_key: str, claim_key: str) -> bool:
    """Is a journal of ``journal_key`` the run of a claim keyed ``claim_key`` (or a later
    attempt of it that started over under ``<key>~<attempt>``)?"""
    return journal_key == claim_key or journal_key.startswith(claim_key + "~")


def first_key(claim_key: str, attempt: int) -> str:
    """A fresh run's key: the claim's on a first attempt; a later attempt with no journal adds
    ``~<attempt>`` (an earlier attempt wrote nothing, so no tool ever saw a key of it)."""
    return claim_key if attempt <= 1 else f"{claim_key}~{attempt}"


def decide(claim_key: str, attempt: int, events: Sequence[int], found: Found | None, max_attempts: int) -> Decision:
    """Fresh, replay or drop: what a claim (its key, attempt and event ids) makes of its user's
    live journal ``found`` (claim rule 3 for ``max_attempts``). Pure: the worker reads the facts
    and carries the decision out, falling back to ``refused`` when a take-up is refused."""
    if found is None:
        return Decision(Opening.FRESH, first_key(claim_key, attempt))
    anew = f"{claim_key}~{attempt}"  # never a key the dropped journal lent to a call
    discard = Decision(Opening.DISCARDED, anew)
    if found.start is None:
        return discard
    if not same_run(found.run_key, claim_key):
        # The user's run in progress, which an operator's retry of an older dead event
        # overtook: it goes first, with its events, unless its first event's lone last attempt
        # is due (it must run alone: this claim steps back, nothing counted).
        refused = Decision(Opening.STEPPED_BACK, claim_key) if found.lone_due else discard
        if attempt >= max_attempts:
            return refused  # a last attempt is never spent on another event's run
        return Decision(Opening.REPLAYED, found.run_key, found.start, refused)
    if attempt < max_attempts or list(found.start) == list(events):
        return Decision(Opening.REPLAYED, found.run_key, found.start, discard)
    # This claim is the lone last attempt of a batch's lead (claim rule 3).
    isolated = Decision(Opening.ISOLATED, anew)
    if found.alone:
        return isolated  # the batch crashed alone before: its lead runs alone afresh
    # Lost only in company so far: the batch replays whole once with nothing else in flight,
    # uncounted (splitting it now would make its calls again under new keys).
    return Decision(Opening.ALONE, found.run_key, found.start, isolated)


def _dumps(value: Any) -> str:
    """Compact JSON by pydantic-core's encoder (the requests' own: a fifth of the stdlib's CPU)."""
    return pydantic_core.to_json(value, fallback=str).decode()
