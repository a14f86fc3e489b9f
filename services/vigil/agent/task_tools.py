"""``tasks_list``, ``task_result`` and ``task_cancel``: a conversation looks at the background
tasks it delegated (docs/tasks.md, "Ownership").

The caller is the run, never the model's arguments: its user and its own owner ids, the
conversation it runs in and its run key, never the user's id (which heads every chain of
theirs, so it would own them all). It sees the tasks whose chain names one of them: those
delegated by this run or by an earlier run of this conversation, and their descendants;
never another run's or conversation's of the same user. The ledger applies the owner rule
on every call (:func:`vigil.ledger.tasks.of_owner`), so a task the caller does not own is
refused exactly as a task that does not exist: the model learns nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vigil.agent.base import TaskDoor, TasksUnavailable
from vigil.agent.tools import TASK_CANCEL, TASK_RESULT, TASKS_LIST, ToolOutput
from vigil.ledger.states import TaskStatus
from vigil.ledger.tasks import TaskRow

INSTRUCTIONS_SHOWN = 120
OPEN = (TaskStatus.QUEUED, TaskStatus.RUNNING)


@dataclass(frozen=True)
class Caller:
    user_id: str
    owners: tuple[str, ...]  # the caller's own ids: its conversation (session id), its run key


async def look(name: str, args: dict[str, Any], door: TaskDoor | None, caller: Caller) -> ToolOutput:
    if door is None:
        return ToolOutput("No tasks here: this worker offers no background tasks.", True)
    try:
        if name == TASKS_LIST:
            return _listed(await door.owned(user_id=caller.user_id, owners=caller.owners))
        task_id = args.get("task_id")
        if not isinstance(task_id, str) or not task_id.strip():
            return ToolOutput("Refused: task_id must be the id delegate gave (tsk_...).", True)
        task_id = task_id.strip()
        owned = await door.owned(user_id=caller.user_id, owners=caller.owners, task_id=task_id)
        if not owned:
            return ToolOutput(f"Refused: there is no task {task_id} of yours.", True)
        if name == TASK_RESULT:
            return ToolOutput(_described(owned[0]))
        assert name == TASK_CANCEL
        cancelled = await door.cancel(task_id=task_id, actor=caller.owners[-1])
    except TasksUnavailable as exc:
        return ToolOutput(f"Could not look: {exc}. Try again later.", True)
    if cancelled is None and owned[0].mode == "sync" and owned[0].status is TaskStatus.RUNNING:
        return ToolOutput(f"Not cancelled: task {task_id} is a sync child; it ends with its run.", True)
    if cancelled is None:
        return ToolOutput(f"Not cancelled: task {task_id} had already ended ({owned[0].status}).", True)
    if cancelled.status is TaskStatus.CANCELLED:
        return ToolOutput(f"Task {task_id} cancelled before it started.")
    return ToolOutput(f"Cancel of task {task_id} requested: its worker stops it within seconds.")


def _listed(tasks: list[TaskRow]) -> ToolOutput:
    if not tasks:
        return ToolOutput("You have no tasks.")
    lines = [
        f"- {t.id} {t.mode} {t.status}, {t.turns} turns, {t.input_tokens + t.output_tokens} tokens: " + _start(t)
        for t in tasks
    ]
    return ToolOutput("Your tasks (background, and sync sub-agents), newest first:\n" + "\n".join(lines))


def _described(task: TaskRow) -> str:
    head = f"Task {task.id} is {task.status} ({task.turns} turns, {_tokens(task)} tokens"
    if task.status in OPEN:
        progress = f", last tool {task.last_tool}" if task.last_tool else ""
        note = f"; its latest note: {task.note}" if task.note else ""
        if task.mode == "sync":
            return f"{head}). It is a sync sub-agent: its answer goes back to the run that called it."
        return f"{head}{progress}){note}. Its result wakes you when it ends."
    if task.status is TaskStatus.SUCCEEDED:
        return f"{head}). Its result:\n{task.result or ''}"
    return f"{head}). {task.error or 'No error recorded.'}"


def _start(task: TaskRow) -> str:
    text = " ".join(task.instructions.split())
    return text if len(text) <= INSTRUCTIONS_SHOWN else text[: INSTRUCTIONS_SHOWN - 1] + "…"


def _tokens(task: TaskRow) -> int:
    return task.input_tokens + task.output_tokens
