"""The ``delegate`` tool: sub-agents, inside the run (sync) or as background tasks.

``delegate(instructions, mode="background"|"sync", tools=[...], budget=N)``:

- **The child's boundary is the parent's, narrowed.** Its tools are action tools the parent
  may use *without asking* (permission ``allow``): a tool the parent may not use, may use
  only after a person approves (``ask``), or only past the classifier (``auto``) cannot
  become freely usable in a child that has nobody to ask. The child never talks to the user
  (no ``send_message``), never sets timers and never touches memory: its answer goes back to
  its parent, which decides what to do with it.
- **Depth is bounded** by ``VIGIL_MAX_DELEGATION_DEPTH`` (a run is depth 0, its children 1).
- **Budgets are shared.** A child's token budget is at most ``VIGIL_TASK_TOKEN_BUDGET`` and
  never more than its parent has left. A sync child's usage is added to the parent run's (so
  it is in ``runs.*_tokens`` and stops the parent when spent); a background task's budget is
  reserved from the parent run's tokens when it is queued (``Budget.reserved``), at most
  ``VIGIL_MAX_TASKS_PER_RUN`` are queued per run, and its usage is kept on its ``tasks`` row
  and added to the parent's ``runs.task_*`` columns when it ends.
- **sync** runs the child now, inside the parent's run and under its deadline, and returns
  its answer as the tool result. **background** adds a task to the run's result: the run's
  fenced finish queues it (a run that does not commit starts nothing), any worker executes
  it (:mod:`vigil.worker.tasks`), and its outcome wakes the delegating session as a
  ``task.*`` event.

A child is a conversation of its own (its own transcript, a short system prompt, only its
tools), run by :func:`run_child` for both modes and for a background task's execution.

**Every child visible.** A sync child is recorded as a task row of mode ``sync``
(:func:`run_sync`, through the run's :class:`~vigil.agent.base.TaskDoor`): running as it
starts, succeeded or failed with its usage as it ends. Its id is derived from the delegate
call's step key, as a background task's is, so a replayed run writes the same row again.
The row is best effort: a write the ledger does not take is logged and counted
(``vigil_sync_task_rows_unwritten_total``), and the child runs all the same. A child's own
delegations name it as their parent (``parent_task_id``): a background task's id, or the
sync child's. A background task's own conversation may delegate background tasks too: they
are queued by the task's terminal write if it succeeds (``Child.spawned``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import anthropic

from vigil.agent import metrics, model
from vigil.agent.base import Delegation, NewTask, SyncOutcome, TaskDoor, TasksUnavailable, TaskUsage
from vigil.agent.journal import HandedOver, Journal
from vigil.agent.memory import MemoryFiles
from vigil.agent.prompt import append_user, text_block, tool_result
from vigil.agent.settings import AgentSettings, Permission
from vigil.agent.tools import (
    DELEGATE,
    MEMORY,
    MEMORY_DEFINITION,
    ActionTool,
    CallContext,
    ToolOutput,
    delegate_definition,
)
from vigil.ledger.states import TaskStatus

log = logging.getLogger(__name__)

MAX_INSTRUCTIONS_CHARS = 8000
NOTE_CHARS = 300  # a task's progress note: the start of the text the child wrote with its last call
MODES = ("background", "sync")
RECORD_TIMEOUT_S = 5.0  # the most a sync child's row write may hold up its run

CHILD_SYSTEM = (
    "You are a sub-agent: another agent delegated one task to you. Do exactly that task with the "
    "tools you have, then answer with the result as plain text: your final answer is handed back "
    "to the agent that asked, never shown to a person. If the task cannot be done with your tools, "
    "say so plainly and stop."
)
CHILD_SYSTEM_ENCODED = model.Encoded.of(CHILD_SYSTEM)


@dataclass(frozen=True)
class Request:
    instructions: str
    mode: str
    tools: tuple[str, ...]
    budget: int
    depth: int


def check(
    args: dict[str, Any],
    delegation: Delegation | None,
    permissions: dict[str, Permission],
    actions: dict[str, ActionTool],
    tokens_left: int,
    tasks_started: int = 0,
    open_tasks: int = 0,
) -> Request | str:
    """The request, or why it is refused (a readable tool error for the model)."""
    if delegation is None:
        return "Not delegated: this worker offers no delegation."
    depth = delegation.child_depth()
    if depth is None:
        return f"Not delegated: sub-agents may be at most {delegation.max_depth} deep, and this one would be deeper."
    instructions, mode = args.get("instructions"), args.get("mode", "background")
    if not isinstance(instructions, str) or not instructions.strip():
        return "Not delegated: instructions must be a non-empty string."
    if len(instructions) > MAX_INSTRUCTIONS_CHARS:
        return f"Not delegated: instructions are over {MAX_INSTRUCTIONS_CHARS} characters."
    if mode not in MODES:
        return f"Not delegated: mode must be one of {', '.join(MODES)}."
    if mode == "background" and tasks_started >= delegation.max_tasks_per_run:
        return (
            f"Not delegated: a run may start at most {delegation.max_tasks_per_run} background tasks, and this "
            "one has. Wait for their results, or do the work yourself or with mode sync."
        )
    bound = delegation.max_open_tasks_per_user
    if mode == "background" and bound is not None and open_tasks + tasks_started >= bound:
        return (
            f"Not delegated: this user may have at most {bound} open background tasks (queued or running), and "
            "has. Wait for their results, cancel one (task_cancel), or do the work yourself or with mode sync."
        )
    tools = args.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        return "Not delegated: tools must be a list of tool names."
    for name in tools:
        if name not in actions:
            return f"Not delegated: {name!r} is not an action tool a sub-agent can be given."
        if permissions.get(name) is not Permission.ALLOW:
            return (
                f"Not delegated: you may not use {name} without asking (its permission is "
                f"{permissions.get(name, Permission.DENY)}), so a sub-agent may not either."
            )
    budget = args.get("budget", delegation.token_budget)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        return "Not delegated: budget must be a positive whole number of tokens."
    budget = min(budget, delegation.token_budget, tokens_left)
    if budget < model.MIN_CALL_TOKENS:
        return "Not delegated: too few tokens are left in this run's budget for a sub-agent."
    return Request(instructions.strip(), mode, tuple(dict.fromkeys(tools)), budget, depth)


def in_conversation(limits: Delegation, session_id: str) -> Delegation:
    """A run's limits as one of its conversations delegates: the chain names the conversation
    after the user (user, session, run key), so the conversation's later runs own the tasks
    too (docs/tasks.md, "The agent looks at its tasks")."""
    user, *rest = limits.owner_chain
    return replace(limits, owner_chain=(user, session_id, *rest))


def background_task(
    request: Request, delegation: Delegation, run_key: str, session_id: str | None, key: str
) -> NewTask:
    """The task the delegate call ``key`` (its step's idempotency key) queues: its id is
    derived from the key, so a replayed run queues the same task, not a second one."""
    return NewTask(
        id=task_id(key),
        instructions=request.instructions,
        tools=request.tools,
        token_budget=request.budget,
        depth=request.depth,
        timeout_s=delegation.timeout_s,
        max_attempts=delegation.max_attempts,
        parent_run_key=run_key,
        owner_chain=delegation.owner_chain,
        session_id=session_id,
        max_open=delegation.max_open_tasks_per_user,
    )


def task_id(key: str) -> str:
    """The task id of the delegate call whose step key is ``key`` (the same on a replay)."""
    return f"tsk_{hashlib.sha256(key.encode()).hexdigest()[:20]}"


@dataclass
class Child:
    """Everything a child conversation runs with."""

    client: anthropic.AsyncAnthropic
    settings: AgentSettings
    retry: model.CallPolicy
    actions: dict[str, ActionTool]
    permissions: dict[str, Permission]
    user_id: str
    key: str  # its task id (a sync child's from its delegate call's key): its owner-chain entry
    tools: tuple[str, ...]
    delegation: Delegation  # the child's own depth
    budget: model.Budget
    usage: TaskUsage  # kept current, so a cancelled child still records what it spent
    # Its steps' journal: a sync child's is its parent run's (the steps are the run's), a
    # background task's its own (vigil.agent.journal). Action keys are its steps' keys.
    journal: Journal
    tasks: TaskDoor | None = None  # where sync children are recorded (None: nowhere)
    session_id: str | None = None  # the delegating conversation, named on sync children's rows
    # A background task's own conversation: the background tasks it delegates, queued by the
    # task's terminal write if it succeeds. None (a sync child): its delegations run sync.
    spawned: list[NewTask] | None = None
    # A memory review (vigil.agent.dreaming): its system prompt, and the user's files, which
    # its one tool, memory, edits. None: a delegated child, which never touches memory.
    system: model.Encoded = CHILD_SYSTEM_ENCODED
    memory: MemoryFiles | None = None


async def run_child(child: Child, instructions: str) -> str:
    """The child's conversation until it answers without calling a tool, or a budget stops it.
    Returns its answer (the text of its last turn)."""
    allowed = [n for n in child.tools if n in child.actions and child.permissions.get(n) is Permission.ALLOW]
    definitions = [child.actions[n].definition() for n in allowed]
    if child.memory is not None:
        allowed, definitions = [], [MEMORY_DEFINITION]  # a memory review: the memory tool only
    elif child.delegation.child_depth() is not None:
        definitions.append(delegate_definition())  # sync, or background from a background task
    tools = model.Encoded.of(definitions) if definitions else None
    messages: list[dict[str, Any]] = [{"role": "user", "content": [text_block(instructions)]}]
    answer = ""
    while True:
        stop = child.budget.exhausted()
        if stop is not None:
            metrics.BUDGET_STOPS.labels(stop).inc()
            return answer or f"(the sub-agent was stopped by its {stop} budget before answering)"
        request = model.Request(
            model=child.settings.model,
            max_tokens=max(
                model.MIN_CALL_TOKENS,
                min(child.settings.max_output_tokens, child.budget.max_tokens - child.budget.spent),
            ),
            system=child.system,
            messages=messages,
            tools=tools,
        )
        content, usage, replayed = await child.journal.model_turn(
            lambda request=request: model.create(child.client, request, child.budget, child.retry)  # type: ignore[misc]
        )
        child.budget.add(usage, billed=not replayed)
        _sync_usage(child)
        if content:
            messages.append({"role": "assistant", "content": content})
        texts = [b["text"] for b in content if b["type"] == "text"]
        if texts:
            answer = "\n".join(texts).strip()
        uses = [b for b in content if b["type"] == "tool_use"]
        child.budget.tool_calls += len(uses)
        if not uses:
            return answer
        if texts:
            child.usage.note = answer[:NOTE_CHARS]
        results = []
        for use in uses:
            output = await _child_tool(child, use, allowed, child.journal.take())
            results.append(tool_result(use["id"], output.text, output.is_error))
        results = child.journal.replayed_results() or results
        child.journal.results(results)
        append_user(messages, results)


async def _child_tool(child: Child, use: dict[str, Any], allowed: list[str], step: int) -> ToolOutput:
    name, args = use["name"], use["input"] if isinstance(use["input"], dict) else {}
    child.usage.last_tool = name
    if child.memory is not None:
        if name != MEMORY:
            return ToolOutput(f"Not permitted: {name} is not one of your tools; memory is.", True)
        return ToolOutput(*child.memory.answer(args))
    if name == DELEGATE:
        return await _child_delegate(child, args, allowed, step)
    if name not in allowed:
        metrics.TOOL_CALLS.labels("unknown" if name not in child.permissions else name, "error").inc()
        return ToolOutput(f"Not permitted: {name} is not one of your tools.", True)
    tool = child.actions[name]
    refusal = tool.check(args)
    if refusal is not None:
        return ToolOutput(refusal, True)
    output = await child.journal.action(
        step, name, args, lambda key: tool.run(args, CallContext(child.user_id, use["id"], key))
    )
    metrics.TOOL_CALLS.labels(name, "error" if output.is_error else "ran").inc()
    return output


async def _child_delegate(child: Child, args: dict[str, Any], allowed: list[str], step: int) -> ToolOutput:
    """A child's own delegation, whose parent is the child (``parent_task_id``): sync, or, from
    a background task's own conversation, background (queued when the task succeeds)."""
    background = child.spawned is not None and args.get("mode", "background") == "background"
    open_tasks = 0
    if background and child.tasks is not None and child.delegation.max_open_tasks_per_user is not None:
        try:
            open_tasks = await child.tasks.open_count(child.user_id)
        except TasksUnavailable as exc:
            return ToolOutput(f"Not delegated: {exc}. Try again later.", True)
    request = check(
        {**args, "mode": "background" if background else "sync"},
        child.delegation,
        child.permissions,
        {n: child.actions[n] for n in allowed},
        child.budget.left,
        tasks_started=len(child.spawned or ()),
        open_tasks=open_tasks,
    )
    if isinstance(request, str):
        return ToolOutput(request, True)
    if background:
        assert child.spawned is not None
        queued = background_task(request, child.delegation, child.key, child.session_id, child.journal.key(step))
        child.spawned.append(replace(queued, parent_task_id=child.key))
        child.budget.reserved += queued.token_budget  # the task may spend it: this one may not
        return ToolOutput(
            f"Background task {queued.id} will be queued when you have answered (if this task succeeds). "
            "Its result goes to the conversation that delegated you, not to you."
        )
    grandchild = nested(child, request, child.journal.key(step))
    try:
        answer = await run_sync(grandchild, request, parent_run_key=child.key, parent_task_id=child.key)
    finally:
        charge(child.budget, grandchild.budget)
        _sync_usage(child)
    return ToolOutput(answer)


def nested(parent: Child | None, request: Request, key: str, **base: Any) -> Child:
    """A sync child's settings, from its parent child (or, with ``base``, from a run); ``key``
    is its delegate call's step key, its task id derived from it."""
    source = base if parent is None else vars(parent)
    delegation: Delegation = source["delegation"]
    deadline = source["budget"].deadline if parent is not None else base["deadline"]
    journal = source["journal"]
    return Child(
        client=source["client"],
        settings=source["settings"],
        retry=source["retry"],
        actions=source["actions"],
        permissions=source["permissions"],
        user_id=source["user_id"],
        key=task_id(key),
        tools=request.tools,
        delegation=replace(delegation, depth=request.depth, owner_chain=(*delegation.owner_chain, task_id(key))),
        budget=model.Budget(source["settings"].max_turns, request.budget, deadline),
        usage=TaskUsage(),
        journal=journal,
        tasks=source.get("tasks"),
        session_id=source.get("session_id"),
    )


async def run_sync(child: Child, request: Request, *, parent_run_key: str, parent_task_id: str | None) -> str:
    """A sync child's conversation (:func:`run_child`), recorded as its task row of mode sync:
    started, then succeeded or failed with its usage (its own sync children's included). A run
    stopped mid-child (cancelled, or handed over at a step boundary) writes no end: a replay
    starts the row again, else the reaper ends it ``lost`` at its deadline (its run's)."""
    row = NewTask(
        id=child.key,
        instructions=request.instructions,
        tools=request.tools,
        token_budget=request.budget,
        depth=request.depth,
        timeout_s=max(child.budget.deadline - time.monotonic(), 0.0),
        max_attempts=1,
        parent_run_key=parent_run_key,
        owner_chain=child.delegation.owner_chain[:-1],
        session_id=child.session_id,
        parent_task_id=parent_task_id,
    )
    await _record(child, "start", lambda door: door.sync_started(user_id=child.user_id, task=row))
    try:
        answer = await run_child(child, request.instructions)
    except HandedOver:
        raise  # the run stopped at a step boundary, not the child: the next owner's replay starts its row again
    except Exception as exc:
        _sync_usage(child)
        failed = SyncOutcome(TaskStatus.FAILED, child.usage, error=f"{type(exc).__name__}: {exc}"[:2000])
        await _record(child, "end", lambda door: door.sync_ended(user_id=child.user_id, task=row, outcome=failed))
        raise
    _sync_usage(child)
    done = SyncOutcome(TaskStatus.SUCCEEDED, child.usage, result=answer)
    await _record(child, "end", lambda door: door.sync_ended(user_id=child.user_id, task=row, outcome=done))
    return answer


async def _record(child: Child, what: str, write: Callable[[TaskDoor], Awaitable[None]]) -> None:
    """One write of a sync child's row, best effort: at most RECORD_TIMEOUT_S, never an error."""
    if child.tasks is None:
        return
    try:
        async with asyncio.timeout(RECORD_TIMEOUT_S):
            await write(child.tasks)
    except (TasksUnavailable, TimeoutError) as exc:
        metrics.SYNC_TASK_ROWS_UNWRITTEN.inc()
        log.warning(
            "sync child %s: its task row's %s was not written (the child runs all the same): %s",
            child.key,
            what,
            exc or "timed out",
            extra={"event": "sync_task_row_unwritten"},
        )


def charge(parent: model.Budget, child: model.Budget) -> None:
    """A sync child's usage counts against its parent's budget (turns included)."""
    parent.turns += child.turns
    parent.input_tokens += child.input_tokens
    parent.output_tokens += child.output_tokens
    parent.cache_read_tokens += child.cache_read_tokens
    parent.cache_write_tokens += child.cache_write_tokens
    parent.tool_calls += child.tool_calls


def _sync_usage(child: Child) -> None:
    child.usage.turns = child.budget.turns
    child.usage.input_tokens = (
        child.budget.input_tokens + child.budget.cache_read_tokens + child.budget.cache_write_tokens
    )
    child.usage.output_tokens = child.budget.output_tokens
