"""One conversation of a run: the loop over model calls and tool calls.

Order of one conversation:

1. A waiting session with no answer here only re-asks on ``approval.escalate``; done.
2. The opening user turn: the deferred call's complete tool-result turn when resuming with
   an answer (the approved tool runs here, once), then the conversation's events.
3. Until the model stops calling tools or a budget runs out: call the model; run each
   tool call through the permission gate; a call that needs approval ends the
   conversation (the session waits); otherwise the results form the next user turn. At
   each model-turn boundary, events that arrived meanwhile are claimed for sources whose
   policy is ``fold`` (added to the turn) or ``interrupt`` (the conversation restarts from
   its opening turn with them, dropping what it drafted since: messages, timers, memory
   edits. Action tool calls already made cannot be undone, so the restart is told of them).

Every model turn and every action call goes through the run's journal
(:mod:`vigil.agent.journal`): a replayed run takes journaled answers and recorded outcomes
instead of asking and acting again, and folds at a journaled boundary exactly the events it
folded there before. Nothing else here writes anywhere but the run's result: a crash at any
point leaves the claim to be retried and replayed; an action call in doubt runs again with
the same idempotency key.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anthropic

from vigil import tracing
from vigil.agent import delegation, metrics, model, task_tools
from vigil.agent.base import ApprovalRequest, EventRow, NewApproval, RunContext, TasksUnavailable
from vigil.agent.deferral import Deferral, defer, escalate, resolve, resumed_turn
from vigil.agent.journal import Journal
from vigil.agent.memory import MemoryFiles, MemoryRefused
from vigil.agent.permissions import BlockCounters, Decision, Gate
from vigil.agent.profiles import DEFAULT
from vigil.agent.prompt import (
    append_user,
    render_events,
    text_block,
    tool_result,
    with_conversation_breakpoint,
)
from vigil.agent.screening import Classifier, provenance, screen_output
from vigil.agent.sessions import Thread
from vigil.agent.settings import AgentSettings, EventPolicy, Permission
from vigil.agent.tools import (
    DELEGATE,
    MEMORY,
    SEND_MESSAGE,
    SET_FOLLOWUP,
    TASK_TOOLS,
    ActionTool,
    CallContext,
    Outputs,
    ToolOutput,
    send_message,
    set_followup,
)

log = logging.getLogger(__name__)

# The calls refused before anything ran: their span's status message and error.type, apart
# from a tool that ran and answered with an error (tool_error).
NOT_RUN = {
    Decision.BLOCK: ("blocked by the safety policy", "blocked"),
    Decision.DENY: ("denied by its permission, or no such tool", "denied"),
    Decision.REFUSED: ("refused by the tool's check of its arguments", "refused"),
}


@dataclass
class Toolbox:
    """What every run of one agent shares: settings, client, tools and their permissions."""

    settings: AgentSettings
    client: anthropic.AsyncAnthropic
    retry: model.CallPolicy
    actions: dict[str, ActionTool]
    permissions: dict[str, Permission]  # every known tool's effective permission
    tools: model.Encoded  # the tools offered (definitions in their fixed order), encoded once
    policies: dict[str, EventPolicy]  # the deployment's (VIGIL_EVENT_POLICIES); a user's may win
    classifier: Classifier | None = None  # auto mode's second opinion (VIGIL_AUTO_CLASSIFIER_MODEL)


@dataclass
class RunState:
    """One run, shared by its conversations."""

    ctx: RunContext
    memory: MemoryFiles
    budget: model.Budget
    now: datetime  # when the run started (the prompt's "now"); tools read the clock when called
    system: model.Encoded  # built and encoded once per run: the cached prefix must not move mid-run
    approvals: dict[str, ApprovalRequest]
    journal: Journal
    start: dict[str, Any]  # what step 1 journals besides its answer: the run's events, now and system
    policies: dict[str, EventPolicy] = field(default_factory=dict)  # this user's, per source
    folded: list[EventRow] = field(default_factory=list)
    stopped_by: str | None = None

    @property
    def fold_sources(self) -> list[str]:
        return sorted(s for s, p in self.policies.items() if p is not EventPolicy.QUEUE)


@dataclass
class Ended:
    outputs: Outputs
    approvals: list[NewApproval] = field(default_factory=list)
    touched: bool = False  # the session changed and must be saved


def tool_span(name: str, call_id: str, tool: ActionTool | None = None):
    """A tool call's span (GenAI semantic conventions), under the run's; nothing when traces are
    off. A tool adds its own attributes (an MCP tool names its server)."""
    if not tracing.enabled:
        return tracing.span(name)
    attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "gen_ai.tool.call.id": call_id}
    if tool is not None:
        attributes.update(tool.span_attributes())
    return tracing.span(f"execute_tool {name}", attributes=attributes)


def profile_attributes(profile: list | tuple | None) -> dict[str, Any]:
    """A run's profile (name and version, None for the deployment's own) as span attributes."""
    if not profile:
        return {"vigil.profile": DEFAULT}
    name, version = profile
    return {"vigil.profile": name, "vigil.profile.version": version}


def agent_span(box: Toolbox, run: RunState, session_id: str):
    """A conversation's ``invoke_agent`` span (GenAI semantic conventions), parent of its model
    and tool spans: the agent is the run's profile, the conversation its session."""
    if not tracing.enabled:
        return tracing.span("invoke_agent")
    profile = profile_attributes(run.start.get("profile"))
    attributes = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": profile.pop("vigil.profile"),
        "gen_ai.conversation.id": session_id,
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": box.settings.model,
        **profile,
    }
    return tracing.span(f"invoke_agent {attributes['gen_ai.agent.name']}", attributes=attributes)


class Conversation:
    def __init__(self, box: Toolbox, run: RunState, thread: Thread):
        self.box = box
        self.run = run
        self.thread = thread
        self.gate = Gate(box.permissions, thread.counters)
        self.outputs = Outputs()

    async def converse(self) -> Ended:
        with agent_span(self.box, self.run, self.thread.session_id):
            return await self._converse()

    async def _converse(self) -> Ended:
        thread, _ctx = self.thread, self.run.ctx
        if thread.waiting and thread.answer is None:
            return self._reask()
        opening: list[dict[str, Any]] = []
        if thread.waiting:
            opening += await self._resume()
        if thread.events:
            opening.append(text_block(render_events(thread.events)))
        if not opening:
            return Ended(self.outputs)
        append_user(thread.messages, opening)
        start = (copy.deepcopy(thread.messages), self.run.memory.checkpoint(), BlockCounters(**vars(thread.counters)))
        folded_here: list[EventRow] = []
        first = True
        while True:
            stop = self.run.budget.exhausted()
            if stop is not None:
                self.run.stopped_by = stop
                metrics.BUDGET_STOPS.labels(stop).inc()
                log.info("run stopped by its %s budget", stop)
                break
            if not first:
                await self._boundary(start, folded_here)
            first = False
            content, usage, replayed = await self.run.journal.model_turn(
                lambda: model.create(self.box.client, self._request(), self.run.budget, self.box.retry),
                self.run.start,
            )
            self.run.budget.add(usage, billed=not replayed)
            if content:  # an empty answer is legal but must not be stored: turns need content
                thread.messages.append({"role": "assistant", "content": content})
            uses = [b for b in content if b["type"] == "tool_use"]
            self.run.budget.tool_calls += len(uses)
            if not uses:
                if self.run.budget.exhausted() is None and await self._boundary(start, folded_here):
                    continue
                break
            results, deferral = await self._call_tools(uses, content)
            if deferral is not None:
                thread.pending = deferral.pending
                self.outputs.messages.append(deferral.question)
                self.outputs.timers.append(deferral.timer)
                return Ended(self.outputs, [deferral.approval], touched=True)
            # A replay takes the results journaled with the next answer: the same bytes the
            # model saw (a builtin's text may depend on the time it ran).
            results = self.run.journal.replayed_results() or results
            self.run.journal.results(results)
            append_user(thread.messages, results)
        return Ended(self.outputs, touched=True)

    # ------------------------------------------------------------------ approvals

    def _reask(self) -> Ended:
        """A waiting session without its answer: an escalation asks again, louder."""
        if not self.thread.escalations:
            return Ended(self.outputs, touched=self.thread.held_now)
        latest = self.thread.escalations[-1].payload_json()
        due = latest.get("due") if isinstance(latest, dict) else None
        secret = self.box.settings.approval_secret.get_secret_value()
        pending = self.thread.pending
        assert pending is not None  # a waiting session holds its deferred call
        base_url = self.box.settings.approval_actions_base_url
        self.thread.pending, message = escalate(pending, due, self.run.ctx.user_id, secret, base_url)
        self.outputs.messages.append(message)
        return Ended(self.outputs, touched=True)

    async def _resume(self) -> list[dict[str, Any]]:
        thread = self.thread
        pending = thread.pending
        assert pending is not None
        request = self.run.approvals.get(pending["request_id"])
        name = pending["tool"]
        # The deferred call's own span, now that it is decided (and, if approved, made).
        with tool_span(name, pending["tool_use_id"], self.box.actions.get(name)) as span:
            resolved, decision = await resolve(
                pending,
                request,
                user_id=self.run.ctx.user_id,
                session_id=thread.session_id,
                gate=self.gate,
                tools=self.box.actions,
            )
            tracing.set_attribute(span, "vigil.tool.decision", decision)
            tracing.set_attribute(span, "vigil.approval.request_id", pending["request_id"])
            if resolved.get("is_error") and decision == "approved":
                tracing.failed(span, "the tool answered with an error", error_type="tool_error")
            elif resolved.get("is_error"):
                tracing.failed(span, f"not run: {decision}", error_type=decision)
        if decision == "approved":
            self.outputs.actions.append(pending["summary"])
        thread.pending = None
        return resumed_turn(pending, resolved)

    # ------------------------------------------------------------------ events mid-run

    async def _boundary(self, start: tuple, folded_here: list[EventRow]) -> bool:
        """Claim events that arrived mid-run (fold / interrupt sources). True if any came."""
        ctx, journal = self.run.ctx, self.run.journal
        replayed = journal.next_model()
        if replayed is not None:
            # A journaled boundary: exactly what was folded here before, nothing that came since.
            ids = replayed.body.get("folded") or []
            events = sorted(await ctx.adopt(ids), key=lambda e: e.id) if ids and ctx.adopt else []
            if len(events) != len(ids):
                log.warning("a replayed boundary folded %d of its %d journaled events", len(events), len(ids))
        else:
            sources = self.run.fold_sources
            if ctx.fold is None or not sources:
                return False
            events = sorted(await ctx.fold(sources, self.thread.session_id), key=lambda e: e.id)
            journal.folded([e.id for e in events])
        if not events:
            return False
        self.run.folded.extend(events)
        folded_here.extend(events)
        if any(e.session_id not in (None, self.thread.session_id) for e in events):
            log.warning("fold returned events that name another session; they join this one")
        interrupt = any(self.run.policies.get(e.source) is EventPolicy.INTERRUPT for e in events)
        metrics.EVENTS_MID_RUN.labels("interrupt" if interrupt else "fold").inc(len(events))
        if not interrupt:
            append_user(self.thread.messages, [text_block(render_events(events))])
            return True
        messages, memory, counters = start
        self.thread.messages = copy.deepcopy(messages)
        self.run.memory.restore(memory)
        self.thread.counters.total, self.thread.counters.consecutive = counters.total, counters.consecutive
        done = self.outputs.actions
        self.outputs = Outputs(actions=list(done))
        blocks = [text_block("New events arrived while you were working; start over with all of them in mind.")]
        if done:
            blocks.append(text_block("Already done before this restart (cannot be undone): " + "; ".join(done)))
        blocks.append(text_block(render_events(folded_here)))
        append_user(self.thread.messages, blocks)
        return True

    # ------------------------------------------------------------------ one model call

    def _request(self) -> model.Request:
        settings, budget = self.box.settings, self.run.budget
        return model.Request(
            model=settings.model,
            max_tokens=max(model.MIN_CALL_TOKENS, min(settings.max_output_tokens, budget.max_tokens - budget.spent)),
            system=self.run.system,
            messages=with_conversation_breakpoint(self.thread.messages),
            tools=self.box.tools,
        )

    # ------------------------------------------------------------------ tools

    async def _call_tools(self, uses: list[dict], turn: list[dict]) -> tuple[list[dict], Deferral | None]:
        results: list[dict[str, Any]] = []
        asked: tuple[ActionTool, dict] | None = None
        for use in uses:
            name, args = use["name"], use["input"] if isinstance(use["input"], dict) else {}
            step = self.run.journal.take()
            fact = self.run.journal.fact(step, name)
            if fact is not None:
                # Made before the replay: its outcome stands whatever the agent allows now.
                tool = self.box.actions.get(name)
                self.outputs.actions.append(tool.describe(args) if tool is not None else name)
                results.append(tool_result(use["id"], screen_output(name, fact.text), fact.is_error))
                continue
            if self._gone_in_doubt(step, name):
                # Its intent is journaled, its outcome is not: it may have acted. The tool is not
                # this run's any more (a deploy, an upgraded profile): not run again, not restarted.
                metrics.TOOL_CALLS.labels(name, "error").inc()
                text = (
                    f"Not run again: this {name} call was made before the run was interrupted and its outcome is "
                    f"unknown; {name} is no longer available to you. Do not assume it succeeded or failed."
                )
                results.append(tool_result(use["id"], text, True))
                continue
            with tool_span(name, use["id"], self.box.actions.get(name)) as span:
                decision: Decision | None = None
                if self.gate.permission(name) is Permission.DENY:
                    # Denied, or no such tool: neither is offered to the model, so only a replayed
                    # answer (given before the tool was denied) or a made-up name comes here.
                    output = ToolOutput(f"Not permitted: there is no tool {name} you may use.", True)
                    decision = Decision.DENY
                    metrics.TOOL_CALLS.labels(name if name in self.box.permissions else "unknown", "denied").inc()
                elif name == DELEGATE:
                    output = await self._delegate(use, args, step)
                    metrics.TOOL_CALLS.labels(DELEGATE, "error" if output.is_error else "ran").inc()
                elif name in TASK_TOOLS:
                    ctx = self.run.ctx
                    # Its own ids only, never the user's: the user is in every chain of theirs.
                    caller = task_tools.Caller(ctx.user_id, (self.thread.session_id, ctx.run_key))
                    output = await task_tools.look(name, args, ctx.tasks, caller)
                    metrics.TOOL_CALLS.labels(name, "error" if output.is_error else "ran").inc()
                elif name in self.box.actions:
                    output, decision = await self._action(self.box.actions[name], use, args, asked is not None, step)
                    if decision is Decision.ASK and asked is None:
                        tracing.set_attribute(span, "vigil.tool.decision", decision.value)
                        asked = (self.box.actions[name], use)
                        continue
                else:
                    output = self._builtin(name, args)
                    metrics.TOOL_CALLS.labels(name, "error" if output.is_error else "ran").inc()
                if decision is not None:
                    tracing.set_attribute(span, "vigil.tool.decision", decision.value)
                if decision in NOT_RUN:
                    tracing.failed(span, NOT_RUN[decision][0], error_type=NOT_RUN[decision][1])
                elif output.is_error:
                    tracing.failed(span, "the tool answered with an error", error_type="tool_error")
            results.append(tool_result(use["id"], output.text, output.is_error))
        if asked is None:
            return results, None
        tool, use = asked
        settings = self.box.settings
        deferral = defer(
            tool,
            use,
            turn,
            results,
            user_id=self.run.ctx.user_id,
            session_id=self.thread.session_id,
            now=datetime.now(UTC),
            deadline_s=settings.approval_deadline_s,
            on_expiry=settings.approval_on_expiry,
            secret=settings.approval_secret.get_secret_value(),
            actions_base_url=settings.approval_actions_base_url,
        )
        metrics.TOOL_CALLS.labels(tool.name, "deferred").inc()
        return results, deferral

    def _gone_in_doubt(self, step: int, name: str) -> bool:
        """Is call ``step`` one in doubt (journaled intent, no outcome) of an action tool this
        run no longer offers?"""
        rec = self.run.journal.recorded.get(step)
        in_doubt = rec is not None and rec.kind == "call" and rec.body.get("name") == name and rec.outcome is None
        return in_doubt and (name not in self.box.actions or self.gate.permission(name) is Permission.DENY)

    async def _delegate(self, use: dict[str, Any], args: dict[str, Any], step: int) -> ToolOutput:
        """The delegate tool: queue a background task in this run's result, or run a child now."""
        run, box = self.run, self.box
        limits = run.ctx.delegation
        if limits is not None:
            limits = delegation.in_conversation(limits, self.thread.session_id)
        try:
            open_tasks = await self._open_tasks(args)
        except TasksUnavailable as exc:
            return ToolOutput(f"Not delegated: {exc}. Try again later.", True)
        request = delegation.check(
            args,
            limits,
            box.permissions,
            box.actions,
            run.budget.left,
            tasks_started=len(self.outputs.tasks),
            open_tasks=open_tasks,
        )
        if isinstance(request, str):
            return ToolOutput(request, True)
        assert limits is not None
        if request.mode == "background":
            task = delegation.background_task(
                request, limits, run.ctx.run_key, self.thread.session_id, run.journal.key(step)
            )
            self.outputs.tasks.append(task)
            run.budget.reserved += task.token_budget  # the task may spend it: this run may not
            return ToolOutput(
                f"Queued as background task {task.id}. You will be woken with its result in this conversation."
            )
        child = delegation.nested(
            None,
            request,
            run.journal.key(step),
            client=box.client,
            settings=box.settings,
            retry=box.retry,
            actions=box.actions,
            permissions=box.permissions,
            user_id=run.ctx.user_id,
            delegation=limits,
            deadline=run.budget.deadline,
            journal=run.journal,
            tasks=run.ctx.tasks,
            session_id=self.thread.session_id,
        )
        try:
            answer = await delegation.run_sync(child, request, parent_run_key=run.ctx.run_key, parent_task_id=None)
            return ToolOutput(answer)
        finally:
            delegation.charge(run.budget, child.budget)

    async def _open_tasks(self, args: dict[str, Any]) -> int:
        """The user's open tasks, read only for a background delegation under a bound."""
        ctx = self.run.ctx
        bounded = ctx.delegation is not None and ctx.delegation.max_open_tasks_per_user is not None
        if not bounded or ctx.tasks is None or args.get("mode", "background") != "background":
            return 0
        return await ctx.tasks.open_count(ctx.user_id)

    def _builtin(self, name: str, args: dict[str, Any]) -> ToolOutput:
        if name == SEND_MESSAGE:
            return send_message(args, self.outputs, self.box.settings)
        if name == SET_FOLLOWUP:
            return set_followup(args, self.outputs, self.box.settings, datetime.now(UTC), self.thread.session_id)
        assert name == MEMORY
        try:
            return ToolOutput(self.run.memory.execute(args))
        except MemoryRefused as refusal:
            return ToolOutput(str(refusal), True)

    async def _action(
        self, tool: ActionTool, use: dict, args: dict, already_asking: bool, step: int
    ) -> tuple[ToolOutput, Decision | None]:
        refusal = tool.check(args)
        if refusal is not None:
            metrics.TOOL_CALLS.labels(tool.name, "error").inc()
            return ToolOutput(f"Not run: {refusal}.", True), Decision.REFUSED
        was_fallen_back = self.gate.counters.fallen_back
        verdict = self.gate.decide(tool.name, tool.risk(args))
        classifier = self.box.classifier
        if (
            classifier is not None
            and verdict.decision is Decision.RUN
            and self.gate.permission(tool.name) is Permission.AUTO
            and not self.run.journal.journaled(step)  # a replayed call was decided when it first ran
        ):
            judgement = await classifier.judge(tool.name, args, provenance(self.thread.messages))
            verdict = self.gate.stricter(verdict, judgement.risk, judgement.unsure)
        if verdict.decision is Decision.RUN:
            user_id = self.run.ctx.user_id
            output = await self.run.journal.action(
                step, tool.name, args, lambda key: tool.run(args, CallContext(user_id, use["id"], key))
            )
            output = ToolOutput(screen_output(tool.name, output.text), output.is_error)
            self.outputs.actions.append(tool.describe(args))
            metrics.TOOL_CALLS.labels(tool.name, "error" if output.is_error else "ran").inc()
            return output, Decision.RUN
        if verdict.decision is Decision.BLOCK:
            metrics.TOOL_CALLS.labels(tool.name, "blocked").inc()
            text = (
                f"Blocked by the safety policy: {verdict.reason}. Do not retry this call as it is; "
                "find another way that does not need it, or tell the person what you would need."
            )
            if self.gate.counters.fallen_back and not was_fallen_back:
                metrics.AUTO_FALLBACKS.inc()
                text += " After repeated blocks, such calls in this conversation now need the person's approval."
            return ToolOutput(text, True), Decision.BLOCK
        if already_asking:
            metrics.TOOL_CALLS.labels(tool.name, "error").inc()
            return ToolOutput(
                "Not run: another call of this turn is already waiting for the person's approval. "
                "Make this call again after that one is answered, if it is still needed.",
                True,
            ), None
        return ToolOutput(""), Decision.ASK
