"""The echo agent: replies to chat messages by repeating them, one line per message.

It makes the whole path (record, claim, run, fenced finish, outbox, delivery) real without a
model, and is what the worker tests and the benchmarks run. Test hooks, read from the
environment so that tests can inject failures into a real worker process:

- ``VIGIL_ECHO_CRASH_ON``: a substring; a chat message containing it SIGKILLs the worker
  (a poison event that takes its process down, as a segfaulting tool would).
- ``VIGIL_ECHO_SLEEP_ON``: ``substring:seconds``; a message containing it makes the run
  sleep that long first (a slow run, for stale-finish and fencing tests).
- ``VIGIL_ECHO_HOLD_FILE``: a path; such a slow run waits until this file exists before its
  sleep (runs held in flight until the test has seen what it waits for, say a hand-over
  begin, however long the processes took to start).
- ``VIGIL_ECHO_FAIL_ON``: a substring; a message containing it raises (a failed attempt).
- ``VIGIL_ECHO_TICK_FILE``: a path; while a task executes, a line ``<instance> <unix time>``
  is appended to it every 50 ms (when a holder acted, for the tests of holders that stop).

Background tasks (docs/tasks.md): a chat message ``delegate: <instructions>`` delegates a
task (no tools) and says so; a ``task.*`` result event is answered with the task's outcome.
Executing a task (:meth:`EchoAgent.run_task`) answers ``done: <instructions>``; the three
hooks above apply to the instructions too, so tests can crash, stall or fail a task's holder.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from vigil.agent.base import NewTask, OutMessage, RunContext, RunResult, TaskContext, TaskResult, Usage
from vigil.ledger.states import RunOutcome

DELEGATE_PREFIX = "delegate:"


class EchoAgent:
    needs_context = False  # echo reads only the events: skip loading session and memory

    def __init__(self) -> None:
        self.crash_on = os.environ.get("VIGIL_ECHO_CRASH_ON") or None
        self.fail_on = os.environ.get("VIGIL_ECHO_FAIL_ON") or None
        sleep = os.environ.get("VIGIL_ECHO_SLEEP_ON", "")
        self.sleep_on, _, seconds = sleep.partition(":")
        self.sleep_s = float(seconds or 0)
        self.tick_file = os.environ.get("VIGIL_ECHO_TICK_FILE") or None
        self.hold_file = os.environ.get("VIGIL_ECHO_HOLD_FILE") or None
        self.instance = os.environ.get("VIGIL_INSTANCE_ID") or str(os.getpid())

    async def _hooks(self, text: str) -> None:
        if self.crash_on and self.crash_on in text:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sleep_on and self.sleep_on in text:
            while self.hold_file and not os.path.exists(self.hold_file):
                await asyncio.sleep(0.05)
            await asyncio.sleep(self.sleep_s)
        if self.fail_on and self.fail_on in text:
            raise RuntimeError(f"echo agent told to fail on {self.fail_on!r}")

    async def run(self, ctx: RunContext) -> RunResult:
        lines = []
        tasks: list[NewTask] = []
        for event in ctx.events:
            payload = event.payload_json()
            if event.kind.startswith("task.") and isinstance(payload, dict):
                outcome = payload.get("result") if payload.get("status") == "succeeded" else payload.get("error")
                lines.append(f"task {payload.get('task_id')} {payload.get('status')}: {outcome}")
                continue
            if event.kind != "chat.message":
                continue
            text = str(payload.get("text", "")) if isinstance(payload, dict) else str(payload)
            if text.startswith(DELEGATE_PREFIX):  # the hooks are for the task's execution, not this run
                lines.append(self._delegate(ctx, text.removeprefix(DELEGATE_PREFIX).strip(), event.session_id, tasks))
                continue
            await self._hooks(text)
            lines.append(text)
        if not lines:
            return RunResult(outcome=RunOutcome.NOTHING)
        # A delegation is the echo agent's only "tool call": counted as a model's would be.
        return RunResult(
            outcome=RunOutcome.MESSAGE,
            messages=[OutMessage("\n".join(lines))],
            tasks=tasks,
            usage=Usage(tool_calls=len(tasks)),
        )

    @staticmethod
    def _delegate(ctx: RunContext, instructions: str, session_id: str | None, tasks: list[NewTask]) -> str:
        limits = ctx.delegation
        depth = limits.child_depth() if limits else None
        if limits is None or depth is None:
            return "delegation refused: past the delegation depth bound"
        task = NewTask(
            id=f"tsk_{uuid.uuid4().hex[:20]}",
            instructions=instructions,
            tools=(),
            token_budget=limits.token_budget,
            depth=depth,
            timeout_s=limits.timeout_s,
            max_attempts=limits.max_attempts,
            parent_run_key=ctx.run_key,
            owner_chain=limits.owner_chain,
            session_id=session_id,
        )
        tasks.append(task)
        return f"started task {task.id}"

    async def run_task(self, ctx: TaskContext) -> TaskResult:
        ctx.usage.turns = 1
        ctx.usage.input_tokens = len(ctx.instructions)
        ctx.usage.last_tool, ctx.usage.note = "echo", f"working on: {ctx.instructions}"[:300]
        ticking = asyncio.create_task(self._tick()) if self.tick_file else None
        try:
            await self._hooks(ctx.instructions)
        finally:
            if ticking is not None:
                ticking.cancel()
        ctx.usage.output_tokens = len(ctx.instructions) + 6
        return TaskResult(f"done: {ctx.instructions}")

    async def _tick(self) -> None:
        assert self.tick_file is not None
        while True:
            with open(self.tick_file, "a") as out:
                out.write(f"{self.instance} {time.time():.3f}\n")
            await asyncio.sleep(0.05)

    async def join_fleet(self, pool: Any, instance: str, user_ledger: Any = None) -> None:
        return None  # no model, nothing to share

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        return []  # no tools, nothing to watch

    def acting_tools(self) -> list[str]:
        return []  # echo calls no tools

    def down(self) -> dict[str, str]:
        return {}  # echo relies on nothing

    async def close(self) -> None:
        return None
