"""Dreaming: a memory review, run as a background task of kind ``memory_review``.

The scheduler queues one for a user after ``VIGIL_DREAM_AFTER_SESSIONS`` new sessions
(:func:`vigil.ledger.dreams.schedule`); any worker executes it like any task
(:mod:`vigil.worker.tasks`), handing it the user's memory files. The review is a child
conversation (:func:`vigil.agent.delegation.run_child`) with its own system prompt and one
tool, ``memory``: it cannot message the person, set timers, delegate or act. Its edits come
back as :class:`MemoryWrite` rows that the task's holder writes only if the task's outcome
stands, each audited in ``memory_history`` (``vigil memory history`` / ``revert``). The
person's instructions file is theirs: a review never changes it.
"""

from __future__ import annotations

from dataclasses import replace

from vigil.agent import model
from vigil.agent.base import TaskContext, TaskResult
from vigil.agent.delegation import Child, run_child
from vigil.agent.memory import Limits, MemoryFiles
from vigil.agent.settings import AgentSettings

REVIEW_SYSTEM = (
    "This is a memory review, run in the background with nobody present. The files under "
    "/memories are notes an assistant agent keeps about one person, written over many "
    "conversations. Tidy them with the memory tool, your only tool:\n"
    "- merge notes that say the same thing into one file and delete the duplicates;\n"
    "- delete notes that are stale: about something finished, past or superseded;\n"
    "- correct a note that a later one contradicts (the later one wins; when you cannot tell, "
    "keep both facts in one note and say which is newer);\n"
    "- keep pointers, not copies: where a note copies an event's payload or a long message, "
    "replace the copy with a one-line summary and its id or link (event id, task id, URL);\n"
    "- never invent a fact, never delete a note you cannot judge, and leave /memories/tasks/ "
    "(work in progress) as it is.\n"
    "When done, answer with one short line per change and why, or 'no changes'."
)
REVIEW_SYSTEM_ENCODED = model.Encoded.of(REVIEW_SYSTEM)


async def review(ctx: TaskContext, base: Child, settings: AgentSettings, limits: Limits) -> TaskResult:
    """Run the review of ``ctx.memory`` on ``base`` (the worker's client, retry and budget);
    its answer and the memory writes to store."""
    own = settings.instructions_path
    files = {p: c for p, c in (ctx.memory or {}).items() if p != own}
    memory = MemoryFiles(files, limits)
    child = replace(
        base,
        tools=(),
        delegation=replace(base.delegation, max_depth=base.delegation.depth),  # no delegation
        spawned=None,
        system=REVIEW_SYSTEM_ENCODED,
        memory=memory,
    )
    opening = f"{ctx.instructions}\n\nThe files now (path -- first line):\n{memory.index(own)}"
    answer = await run_child(child, opening)
    writes = [w for w in memory.writes() if w.path != own]
    return TaskResult(answer, writes)
