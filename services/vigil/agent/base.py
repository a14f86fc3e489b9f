"""The interface between the worker and whatever runs the agent.

A run is ``events + session + memory -> RunResult``. The agent never writes to the ledger
itself: everything it wants to happen (messages, follow-up timers, approval requests,
memory writes, the saved session) comes back in the :class:`RunResult`, and the worker
commits all of it in one fenced transaction, or none of it when the claim went stale. That
is what makes a slow worker's late finish harmless.

The one exception is :meth:`RunContext.fold`, which claims more of the user's events under
the same fenced epoch at a model-turn boundary (the ``fold`` policy for events that arrive
mid-run).

Sessions: every session an event of the claim names (``session_id``) is loaded into
``RunContext.sessions`` (``session`` is the first of them, for callers that handle one).
A run may resume several (two approvals answered at once); each one it touched comes back
as ``RunResult.session`` (the run's main one) or in ``RunResult.other_sessions``.
:func:`vigil.agent.run_ledger.load_context_parts` and
:func:`vigil.agent.run_ledger.session_rows` (executed in the worker's fenced finish,
:mod:`vigil.worker.finish`) do the ledger side of both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from vigil.agent.journal import Journal
from vigil.errors import VigilError

# EventRow is a ledger row (vigil.ledger.events); the agent interface names it here too.
from vigil.ledger.events import EventRow as EventRow
from vigil.ledger.journal import Live
from vigil.ledger.states import CatchUp, OnExpiry, RunOutcome, TaskStatus
from vigil.ledger.tasks import TaskRow


@dataclass(frozen=True, slots=True)
class SavedSession:
    id: str
    state: str  # SessionState value
    messages: list[dict[str, Any]]
    blocks: int = 0  # auto-mode permission blocks in this session, in total
    consecutive_blocks: int = 0  # ... since the last auto-mode call that passed
    # While waiting: the deferred tool call (request_id, tool_use_id, tool, input, args_hash,
    # due, the results of the calls made beside it). Column sessions.pending.
    pending: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """An ``approvals`` row as the resuming run needs it."""

    request_id: str
    session_id: str
    tool: str
    tool_use_id: str | None
    args_hash: str  # what the person approved: the run refuses to execute anything else
    answer: str | None  # ApprovalAnswer value, None while open


@dataclass(frozen=True, slots=True)
class Delegation:
    """What a run (or a task) may delegate, as the worker's settings bound it (docs/tasks.md)."""

    depth: int  # of the delegating run: 0 for a run, the task's depth for a task
    max_depth: int  # VIGIL_MAX_DELEGATION_DEPTH: a child deeper than this is refused
    token_budget: int  # VIGIL_TASK_TOKEN_BUDGET: the most a child may use (and never more than is left)
    timeout_s: float  # VIGIL_TASK_TIMEOUT_S: a background child's deadline, from its creation
    max_attempts: int  # VIGIL_TASK_MAX_ATTEMPTS: holders lost before the task is lost
    owner_chain: tuple[str, ...]  # user id, then the run key and task ids that led here
    max_tasks_per_run: int = 8  # VIGIL_MAX_TASKS_PER_RUN: background tasks one run may start
    max_open_tasks_per_user: int | None = None  # VIGIL_MAX_OPEN_TASKS_PER_USER: queued or running at once

    def child_depth(self) -> int | None:
        """The depth a child would have, or None if that is past the bound."""
        depth = self.depth + 1
        return depth if depth <= self.max_depth else None


class TaskDoor(Protocol):
    """The ledger's background tasks, as the worker lets a run look at them
    (:mod:`vigil.worker.task_door`). Both calls apply the owner rule in the ledger itself."""

    async def owned(self, *, user_id: str, owners: Sequence[str], task_id: str | None = None) -> list[TaskRow]:
        """The tasks a caller with these owner ids may see, newest first (with ``task_id``: that one, or none)."""

    async def cancel(self, *, task_id: str, actor: str) -> TaskRow | None:
        """Cancel (queued) or ask to stop (running); None: already terminal."""

    async def open_count(self, user_id: str) -> int:
        """How many of the user's background tasks are queued or running."""

    async def sync_started(self, *, user_id: str, task: NewTask) -> None:
        """Record a sync child starting (mode sync, running): its row, or the same row again."""

    async def sync_ended(self, *, user_id: str, task: NewTask, outcome: SyncOutcome) -> None:
        """Record how a sync child ended, with its usage (its row written first if it is missing)."""


class TasksUnavailable(VigilError):
    """The ledger did not answer a look at the tasks (the tool says so; the run goes on)."""


@dataclass(slots=True)
class RunContext:
    user_id: str
    # The run's identity, the same across attempts, epochs and workers until its events finish
    # (vigil.ledger.journal): tool idempotency keys are "<run_key>:<step>".
    run_key: str
    events: list[EventRow]
    session: SavedSession | None
    memory: dict[str, str]  # path -> content, the user's files under /memories
    recent_messages: list[str]  # what was already delivered to the user, newest last
    started_at: datetime
    deadline: float  # time.monotonic() by which the run must finish
    # fold(sources, session_id): claims the user's newly pending events of these sources that
    # carry no session_id or name session_id (the conversation in progress), under this run's
    # epoch (fold and interrupt policies).
    fold: Callable[[Sequence[str], str | None], Awaitable[list[EventRow]]] | None = None
    # Answers to approval requests that this run resumes, request_id -> "yes" | "no" | "expired".
    approvals: dict[str, str] = field(default_factory=dict)
    # Messages already sent by earlier runs that the outbox still holds (pacing gap, a retry),
    # oldest first: not delivered yet, but the agent must not say them again.
    queued_messages: list[str] = field(default_factory=list)
    # The user's events that died (attempts used up) since their last run that did not fail:
    # dicts of id, source, kind, received_at, attempts, error. The agent hears of them once.
    dead_events: list[dict[str, Any]] = field(default_factory=list)
    # The user's own event policies (``agent_policies``, VIGIL_EVENT_POLICIES's syntax): they
    # win over the deployment's, source by source.
    event_policies: str = ""
    # Every session named by an event of the claim, by id (``session`` is one of them).
    sessions: dict[str, SavedSession] = field(default_factory=dict)
    # The approval rows named by approval.* events of the claim, by request id.
    approval_requests: dict[str, ApprovalRequest] = field(default_factory=dict)
    # What this run may delegate (None: the worker offers no delegation).
    delegation: Delegation | None = None
    # The run's journal: its steps so far when the run is a replay, and where new ones go (set
    # by the worker, vigil.worker.journal.open_run). None: the agent keeps a journal of its own
    # that writes nothing.
    journal: Journal | None = None
    # The user's live journals as read with the context, oldest lead first, for the worker to
    # open the run against (None: not read); the worker clears it once the run's journal is open.
    found: list[Live] | None = None
    # adopt(ids): claims these events of the user by id under this run's epoch (a replay's
    # events folded at a journaled boundary that the claim did not bring).
    adopt: Callable[[Sequence[int]], Awaitable[list[EventRow]]] | None = None
    # The ledger's tasks as this run may see them (tasks_list, task_result, task_cancel) and
    # where its sync children are recorded; None: those tools answer that there is nothing to
    # look at, and sync children leave no row.
    tasks: TaskDoor | None = None


@dataclass(frozen=True, slots=True)
class OutMessage:
    text: str
    urgent: bool = False
    # Where it goes, not what it says (so not compared): the conversation that wrote it (its
    # delivery names the session, and a reply to the delivery resumes it; None for agents
    # without sessions), and an approval question's deadline (the message is worthless after
    # it, so the dispatcher never holds it behind the urgent cap).
    session_id: str | None = field(default=None, compare=False)
    deadline: datetime | None = field(default=None, compare=False)
    # An approval question's approve / deny actions (signed answer URLs), rendered by the
    # dispatcher's channels so a chat app can show buttons (outbox.actions).
    actions: tuple[dict[str, Any], ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class NewTimer:
    """A one-off follow-up (or an approval's expiry) the run sets for its user."""

    id: str
    due: datetime
    kind: str = "followup"
    payload: dict[str, Any] = field(default_factory=dict)
    fixed_key: str | None = None
    catch_up: CatchUp = CatchUp.COALESCE


@dataclass(frozen=True, slots=True)
class NewApproval:
    request_id: str
    session_id: str
    tool: str
    tool_use_id: str
    args_hash: str
    due: datetime
    on_expiry: OnExpiry = OnExpiry.DENY


@dataclass(frozen=True, slots=True)
class MemoryWrite:
    path: str
    content: str | None  # None deletes the file


@dataclass(frozen=True, slots=True)
class SessionSave:
    id: str
    state: str  # SessionState value
    messages: list[dict[str, Any]]
    blocks: int = 0
    consecutive_blocks: int = 0
    pending: dict[str, Any] | None = None  # the deferred call while state is waiting, else None
    # The messages as JSON, when the agent already encoded them to measure them: the finish
    # stores these bytes instead of encoding the conversation again.
    encoded: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class NewTask:
    """A background task the run delegates: inserted by its fenced finish, executed by any worker."""

    id: str
    instructions: str
    tools: tuple[str, ...]  # a subset of what the delegating run may use without asking
    token_budget: int
    depth: int
    timeout_s: float
    max_attempts: int
    parent_run_key: str
    owner_chain: tuple[str, ...]
    session_id: str | None = None  # the session its result resumes
    parent_task_id: str | None = None
    max_open: int | None = None  # VIGIL_MAX_OPEN_TASKS_PER_USER, enforced again by the finish's insert


@dataclass(frozen=True, slots=True)
class Usage:
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    tool_calls: int = 0  # tool_use blocks the model sent, whatever became of them (runs.tool_calls)


@dataclass(slots=True)
class RunResult:
    outcome: RunOutcome = RunOutcome.NOTHING
    messages: list[OutMessage] = field(default_factory=list)
    timers: list[NewTimer] = field(default_factory=list)
    approvals: list[NewApproval] = field(default_factory=list)
    memory_writes: list[MemoryWrite] = field(default_factory=list)
    session: SessionSave | None = None
    # Further sessions the run resumed or closed (several approvals answered in one claim).
    other_sessions: list[SessionSave] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    # Events claimed mid-run through fold(); the finish marks them done with the rest.
    folded_event_ids: list[int] = field(default_factory=list)
    # Background tasks delegated by the run: queued only if its finish commits.
    tasks: list[NewTask] = field(default_factory=list)
    # The agent profile (name, version) the run ran with; None: the default (runs.profile).
    profile: tuple[str, int] | None = None


@dataclass(slots=True)
class TaskUsage:
    """A task's usage so far: kept up to date while it runs, so a cancel records what was spent."""

    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    last_tool: str | None = None  # the last tool the child called
    note: str | None = None  # the text the child wrote with that call (cut to NOTE_CHARS)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class SyncOutcome:
    """How a sync child ended, for its task row."""

    status: TaskStatus  # succeeded or failed
    usage: TaskUsage
    result: str | None = None
    error: str | None = None


@dataclass(slots=True)
class TaskContext:
    """A background task as the agent executing it sees it."""

    task_id: str
    user_id: str
    instructions: str
    tools: tuple[str, ...]
    token_budget: int
    deadline: float  # time.monotonic() by which it must end
    delegation: Delegation  # the task's own depth: it may delegate further only within the bound
    attempt: int
    usage: TaskUsage = field(default_factory=TaskUsage)
    lease_epoch: int = 0  # the holder's lease: without a journal, its keys are its own
    journal: Journal | None = None  # the task's journal, fenced by its lease (vigil.worker.journal.open_journal)
    tasks: TaskDoor | None = None  # where its sync children are recorded (None: nowhere)
    session_id: str | None = None  # the delegating conversation (its sync children's rows name it)
    # The background tasks it delegates (parent_task_id: this task): the agent appends, the
    # holder's terminal write queues them if the task succeeded.
    spawned: list[NewTask] = field(default_factory=list)
    # 'delegated', or 'memory_review' (docs/agent.md, "Dreaming"): a review is given the user's
    # memory files (path -> content) and the memory tool only.
    kind: str = "delegated"
    memory: dict[str, str] | None = None
    profile: tuple[str, int] | None = None  # the delegating run's profile version; None: the default


@dataclass(frozen=True, slots=True)
class TaskResult:
    text: str  # the child's answer, handed to the parent as the task's result
    # A memory review's changes: written, audited, only if its outcome stands.
    memory_writes: list[MemoryWrite] = field(default_factory=list)


class RetryLater(VigilError):
    """The run could not finish for a reason that is not the event's fault (the model API is
    overloaded). The claim is released with a backoff and does not count toward the poison
    bound, only toward ``VIGIL_TRANSIENT_MAX_ATTEMPTS``."""

    def __init__(self, reason: str, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class OverBudget(RetryLater):
    """The user's daily token budget is spent: the run is not started, and its events wait
    ``retry_after`` seconds (to the next UTC day) without counting an attempt of any kind."""


class Agent(Protocol):
    """Runs one claim. Raising fails the attempt (counted toward the poison bound), except
    :class:`RetryLater`."""

    async def run(self, ctx: RunContext) -> RunResult: ...

    async def run_task(self, ctx: TaskContext) -> TaskResult: ...

    async def join_fleet(self, pool: Any, instance: str, user_ledger: Callable[[str], Any] | None = None) -> None:
        """Share what the deployment's workers share toward the model (the fleet's gate):
        ``pool`` is the catalog's; ``user_ledger(user_id)``, the pool of the user's ledger
        shard (None: the catalog holds every user)."""
        ...

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """What the worker runs beside the runs for its whole life (a loop that raises stops
        the worker): for the Claude agent, listing again the MCP servers that were down."""
        ...

    def acting_tools(self) -> list[str]:
        """The tools that may act on the world when called (the worker refuses to run them
        without a journal unless told to: VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS)."""
        ...

    def down(self) -> dict[str, str]:
        """What the agent relies on that does not answer now, and why (the worker's /readyz
        names it without failing: the runs go on without it)."""
        ...

    async def close(self) -> None: ...
