"""The tools the model is offered: the built-in ones (``BUILTIN``), and a registry of action tools.

Built in (they only shape the run's result, so they are always ``allow`` or ``deny``):

- ``delegate(instructions, mode, tools, budget)``: a sub-agent, now or as a background task
  (:mod:`vigil.agent.delegation`).

- ``tasks_list()``, ``task_result(task_id)``, ``task_cancel(task_id)``: the background tasks
  the agent delegated (:mod:`vigil.agent.task_tools`).

- ``send_message(text, urgent=false)``: a message for the outbox, the first way a run ends.
  Not calling it is the quiet default: nothing is sent.
- ``set_followup(delay_seconds | at, note)``: a one-off timer that wakes this user's agent
  later with the note.
- ``memory``: Anthropic's memory tool over the user's files (:mod:`vigil.agent.memory`).

Action tools act on the world. Each is an :class:`ActionTool` subclass in the
registry (:mod:`vigil.agent.actions`): built in, from a tool package, or from an MCP
server; docs/agent.md, "Adding tools", walks through each. The
executor, not the model, hands a tool its idempotency key and any credential.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar
from uuid import uuid4

from vigil.agent.base import NewTask, NewTimer, OutMessage

# A tool's outcome is what the journal records and replays: defined there, offered here to tools.
from vigil.agent.journal import ToolOutput as ToolOutput
from vigil.agent.settings import AgentSettings, Permission
from vigil.ledger.states import TimerKind

SEND_MESSAGE = "send_message"
SET_FOLLOWUP = "set_followup"
MEMORY = "memory"
MEMORY_DEFINITION = {"type": "memory_20250818", "name": MEMORY}  # Anthropic's memory tool
DELEGATE = "delegate"  # defined in vigil.agent.delegation
TASKS_LIST, TASK_RESULT, TASK_CANCEL = "tasks_list", "task_result", "task_cancel"  # vigil.agent.task_tools
TASK_TOOLS = (TASKS_LIST, TASK_RESULT, TASK_CANCEL)
BUILTIN = (SEND_MESSAGE, SET_FOLLOWUP, MEMORY, DELEGATE, *TASK_TOOLS)
MAX_MESSAGE_CHARS = 4000
MAX_NOTE_CHARS = 1000


@dataclass(frozen=True)
class CallContext:
    """What the executor gives an action tool besides the model's arguments."""

    user_id: str
    tool_use_id: str
    # Stable for this call: the approval's request id when the call was approved, else the
    # claim's run key and the tool_use id. Pass it to the target system so a retried run
    # (a crash before the finish committed) does not act twice.
    idempotency_key: str


class ActionTool(ABC):
    """A tool that acts outside the run. Subclass, fill the class attributes, register it."""

    name: ClassVar[str]
    description: str  # a class attribute, or set per instance (http_request names its hosts)
    input_schema: dict[str, Any]
    default_permission: ClassVar[Permission] = Permission.ASK
    server: str | None = None  # the MCP server behind the tool (vigil.agent.mcp_tools), for its span
    # A tool that only reads (an MCP tool's readOnlyHint): running it twice changes nothing, so
    # it needs no journal (the worker's start-up check, VIGIL_RUN_JOURNAL). Every other acts.
    read_only: bool = False

    def definition(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "input_schema": self.input_schema}

    def span_attributes(self) -> dict[str, str]:
        """Attributes of this tool's ``execute_tool`` spans besides its name and call id."""
        return {"gen_ai.tool.type": "function"}

    def check(self, args: dict[str, Any]) -> str | None:
        """A reason these arguments can never run (whatever the permission), or None."""
        return None

    def risk(self, args: dict[str, Any]) -> str | None:
        """Auto mode's policy check: why this call is too risky to run unattended, or None."""
        return None

    def describe(self, args: dict[str, Any]) -> str:
        """One line for the approval question: what exactly the person is asked to allow."""
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(args.items()))
        return f"{self.name}({shown})"

    @abstractmethod
    async def run(self, args: dict[str, Any], call: CallContext) -> ToolOutput:
        """Do it. Raise nothing the model should not read: failures are ToolOutput(is_error=True)."""


@dataclass
class Outputs:
    """What one conversation produced for the result (dropped whole if it is interrupted)."""

    messages: list[OutMessage] = field(default_factory=list)
    timers: list[NewTimer] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # action tool calls that ran, described
    tasks: list[NewTask] = field(default_factory=list)  # background tasks delegated (delegate tool)


def builtin_definitions(settings: AgentSettings) -> dict[str, dict[str, Any]]:
    return {
        SEND_MESSAGE: {
            "name": SEND_MESSAGE,
            "description": (
                "Send a message to the user. This is the only way to reach them: text you write "
                "outside this tool is never delivered. Send only what is worth their attention; "
                "saying nothing is fine. urgent=true skips the pacing gap: use it only for what "
                f"cannot wait. At most {settings.max_messages_per_run} per run."
            ),
            "input_schema": {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "description": f"The message, at most {MAX_MESSAGE_CHARS} characters."},
                    "urgent": {
                        "type": "boolean",
                        "description": "Deliver now, bypassing the pacing gap.",
                        "default": False,
                    },
                },
                "required": ["text"],
                "additionalProperties": False,
            },
        },
        SET_FOLLOWUP: {
            "name": SET_FOLLOWUP,
            "description": (
                "Wake yourself up later for this user: a one-off follow-up that arrives as a "
                "timer.followup event carrying your note. Give delay_seconds or at (ISO 8601 with "
                "a UTC offset), not both. Write the note so that your future self, who will not "
                "remember this conversation, knows what to do."
            ),
            "input_schema": {
                "type": "object",
                "properties": {
                    "delay_seconds": {"type": "integer", "minimum": 1, "description": "Seconds from now."},
                    "at": {"type": "string", "description": "When, e.g. 2030-01-31T09:00:00+01:00."},
                    "note": {"type": "string", "description": "What to do then."},
                },
                "required": ["note"],
                "additionalProperties": False,
            },
        },
        MEMORY: MEMORY_DEFINITION,
        DELEGATE: delegate_definition(),
        **task_definitions(),
    }


def task_definitions() -> dict[str, dict[str, Any]]:
    """The tools over the agent's own background tasks (executed by :mod:`vigil.agent.task_tools`)."""
    task_id = {
        "type": "object",
        "properties": {"task_id": {"type": "string", "description": "The id delegate gave, tsk_..."}},
        "required": ["task_id"],
        "additionalProperties": False,
    }
    return {
        TASKS_LIST: {
            "name": TASKS_LIST,
            "description": (
                "List the tasks delegated in this conversation (now or in an earlier turn) and the "
                "sub-tasks they delegated, newest first: id, status, progress and the start of their instructions."
            ),
            "input_schema": {"type": "object", "properties": {}, "additionalProperties": False},
        },
        TASK_RESULT: {
            "name": TASK_RESULT,
            "description": (
                "Read one of your background tasks: its status and, once it ended, its "
                "result or error. A task that has not ended wakes you with its result when it does."
            ),
            "input_schema": task_id,
        },
        TASK_CANCEL: {
            "name": TASK_CANCEL,
            "description": (
                "Cancel one of your background tasks: a queued one at once, a running one "
                "within seconds (it keeps what it spent). A task that already ended is left as it is."
            ),
            "input_schema": task_id,
        },
    }


def delegate_definition() -> dict[str, Any]:
    """The ``delegate`` tool (executed by :mod:`vigil.agent.delegation`)."""
    return {
        "name": DELEGATE,
        "description": (
            "Hand a self-contained piece of work to a sub-agent. mode=background (default) queues "
            "it as a background task: you are woken later with its result as a task.* event, in "
            "this conversation. mode=sync runs it now and returns its answer here (it counts "
            "against this run's time and tokens). The sub-agent starts from your instructions "
            "alone, so include everything it needs. tools: action tools it may use, only ones you "
            "may use without asking."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "instructions": {"type": "string", "description": "The task, complete and self-contained."},
                "mode": {"type": "string", "enum": ["background", "sync"], "default": "background"},
                "tools": {"type": "array", "items": {"type": "string"}, "description": "Action tools it may use."},
                "budget": {"type": "integer", "minimum": 1, "description": "Most tokens it may use."},
            },
            "required": ["instructions"],
            "additionalProperties": False,
        },
    }


def send_message(args: dict[str, Any], outputs: Outputs, settings: AgentSettings) -> ToolOutput:
    text, urgent = args.get("text"), args.get("urgent", False)
    if not isinstance(text, str) or not text.strip():
        return ToolOutput("Not sent: text must be a non-empty string.", True)
    if len(text) > MAX_MESSAGE_CHARS:
        return ToolOutput(f"Not sent: {len(text)} characters, the limit is {MAX_MESSAGE_CHARS}. Shorten it.", True)
    if not isinstance(urgent, bool):
        return ToolOutput("Not sent: urgent must be true or false.", True)
    if len(outputs.messages) >= settings.max_messages_per_run:
        return ToolOutput(f"Not sent: this run already sent {len(outputs.messages)} messages, the limit.", True)
    outputs.messages.append(OutMessage(text.strip(), urgent))
    return ToolOutput("Queued for delivery" + (" (urgent)." if urgent else "."))


def _followup_due(args: dict[str, Any], now: datetime) -> datetime | str:
    delay, at = args.get("delay_seconds"), args.get("at")
    if (delay is None) == (at is None):
        return "give exactly one of delay_seconds and at"
    if delay is not None:
        if not isinstance(delay, int) or isinstance(delay, bool) or delay < 1:
            return "delay_seconds must be a whole number of seconds, at least 1"
        return now + timedelta(seconds=delay)
    if not isinstance(at, str):
        return "at must be an ISO 8601 string"
    try:
        when = datetime.fromisoformat(at)
    except ValueError:
        return f"at={at!r} is not ISO 8601"
    if when.tzinfo is None:
        return "at needs a UTC offset (e.g. +00:00), or the time is ambiguous"
    return when


def set_followup(
    args: dict[str, Any], outputs: Outputs, settings: AgentSettings, now: datetime, session_id: str | None = None
) -> ToolOutput:
    """A follow-up timer; its payload names the conversation that set it (``session_id``), so
    the scheduler's ``timer.followup`` event resumes that conversation, not a new one."""
    note = args.get("note")
    if not isinstance(note, str) or not note.strip():
        return ToolOutput("Not set: a note is required.", True)
    if len(note) > MAX_NOTE_CHARS:
        return ToolOutput(f"Not set: the note is over {MAX_NOTE_CHARS} characters.", True)
    due = _followup_due(args, now)
    if isinstance(due, str):
        return ToolOutput(f"Not set: {due}.", True)
    # Timers are kept in whole seconds; rounding up never fires early.
    due = datetime.fromtimestamp(math.ceil(due.timestamp()), UTC)
    if due <= now:
        return ToolOutput("Not set: that time is already past.", True)
    if (due - now).total_seconds() > settings.followup_max_delay_s:
        return ToolOutput(f"Not set: at most {settings.followup_max_delay_s} seconds ahead.", True)
    if len(outputs.timers) >= settings.max_followups_per_run:
        return ToolOutput("Not set: this run already set the most follow-ups it may.", True)
    timer_id = f"followup-{uuid4().hex}"
    payload: dict[str, Any] = {"note": note.strip()}
    if session_id is not None:
        payload["session_id"] = session_id
    outputs.timers.append(NewTimer(timer_id, due, TimerKind.FOLLOWUP.value, payload))
    return ToolOutput(f"Follow-up {timer_id} set for {due.isoformat()}.")
