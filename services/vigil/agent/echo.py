"""The echo agent: replies to chat messages by repeating them, one line per message.

It makes the whole path (record, claim, run, fenced finish, outbox, delivery) real without a
model, and is what the worker tests and the benchmarks run. Test hooks, read from the
environment so that tests can inject failures into a real worker process:

- ``VIGIL_ECHO_CRASH_ON``: a substring; a chat message containing it SIGKILLs the worker
  (a poison event that takes its process down, as a segfaulting tool would).
- ``VIGIL_ECHO_SLEEP_ON``: ``substring:seconds``; a message containing it makes the run
  sleep that long first (a slow run, for stale-finish and fencing tests).
- ``VIGIL_ECHO_FAIL_ON``: a substring; a message containing it raises (a failed attempt).
"""

from __future__ import annotations

import asyncio
import os
import signal

from vigil.agent.base import OutMessage, RunContext, RunResult
from vigil.ledger.states import RunOutcome


class EchoAgent:
    needs_context = False  # echo reads only the events: skip loading session and memory

    def __init__(self) -> None:
        self.crash_on = os.environ.get("VIGIL_ECHO_CRASH_ON") or None
        self.fail_on = os.environ.get("VIGIL_ECHO_FAIL_ON") or None
        sleep = os.environ.get("VIGIL_ECHO_SLEEP_ON", "")
        self.sleep_on, _, seconds = sleep.partition(":")
        self.sleep_s = float(seconds or 0)

    async def run(self, ctx: RunContext) -> RunResult:
        lines = []
        for event in ctx.events:
            if event.kind != "chat.message":
                continue
            payload = event.payload_json()
            text = str(payload.get("text", "")) if isinstance(payload, dict) else str(payload)
            if self.crash_on and self.crash_on in text:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.sleep_on and self.sleep_on in text:
                await asyncio.sleep(self.sleep_s)
            if self.fail_on and self.fail_on in text:
                raise RuntimeError(f"echo agent told to fail on {self.fail_on!r}")
            lines.append(text)
        if not lines:
            return RunResult(outcome=RunOutcome.NOTHING)
        return RunResult(outcome=RunOutcome.MESSAGE, messages=[OutMessage("\n".join(lines))])

    async def close(self) -> None:
        return None
