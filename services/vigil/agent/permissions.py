"""Which tool calls run unattended, which wait for the user, which never happen.

Each tool has a permission (its default, overridden by ``VIGIL_TOOL_PERMISSIONS``):

- ``allow``: runs.
- ``deny``: the tool is not offered to the model at all; a call anyway (a stale session,
  a confused model) is answered "not permitted".
- ``ask``: every call is deferred: the run ends and the user is asked (see
  :mod:`vigil.agent.deferral`).
- ``auto``: a policy check (the tool's :meth:`risk`) decides per call. A risky call is
  blocked and the model is told to find another way. Blocks are counted per session; after
  :data:`MAX_CONSECUTIVE_BLOCKS` in a row or :data:`MAX_TOTAL_BLOCKS` in all, the session
  stops trusting auto mode and every later auto call asks instead, for the rest of the
  session: a model that keeps pushing against the policy needs a person, not a fourth no.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from vigil.agent.settings import Permission

# Claude Code's thresholds for leaving auto mode, which the design adopts.
MAX_CONSECUTIVE_BLOCKS = 3
MAX_TOTAL_BLOCKS = 20


class Decision(StrEnum):
    """What became of a call; the value is its span's ``vigil.tool.decision``."""

    RUN = "run"
    ASK = "ask"
    BLOCK = "block"
    DENY = "deny"
    REFUSED = "refused"  # the tool's own check refused the arguments: the gate was never asked


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str = ""  # for BLOCK: what the policy objected to


@dataclass
class BlockCounters:
    """Auto-mode blocks of one session (stored on the session row)."""

    total: int = 0
    consecutive: int = 0

    @property
    def fallen_back(self) -> bool:
        return self.consecutive >= MAX_CONSECUTIVE_BLOCKS or self.total >= MAX_TOTAL_BLOCKS


class Gate:
    """Decides each call of one session's conversation."""

    def __init__(self, permissions: dict[str, Permission], counters: BlockCounters):
        self.permissions = permissions
        self.counters = counters

    def permission(self, tool: str) -> Permission:
        return self.permissions.get(tool, Permission.DENY)

    def decide(self, tool: str, risk: str | None) -> Verdict:
        """``risk`` is the tool's own policy verdict on these arguments (None: harmless)."""
        permission = self.permission(tool)
        if permission is Permission.ALLOW:
            return Verdict(Decision.RUN)
        if permission is Permission.DENY:
            return Verdict(Decision.DENY)
        if permission is Permission.ASK or self.counters.fallen_back:
            return Verdict(Decision.ASK)
        if risk is None:
            self.counters.consecutive = 0
            return Verdict(Decision.RUN)
        self.counters.total += 1
        self.counters.consecutive += 1
        return Verdict(Decision.BLOCK, risk)

    def stricter(self, verdict: Verdict, risk: str | None, unsure: bool) -> Verdict:
        """A second opinion on a call ``decide`` let run (auto mode's classifier): it may only
        tighten it. A risk blocks (and counts as a block); no answer asks the person."""
        if verdict.decision is not Decision.RUN:
            return verdict
        if unsure:
            return Verdict(Decision.ASK)
        if risk is None:
            return verdict
        self.counters.total += 1
        self.counters.consecutive += 1
        return Verdict(Decision.BLOCK, risk)

    def may_run_approved(self, tool: str) -> bool:
        """An approved call is checked again when it resumes: a tool denied since is refused."""
        return tool in self.permissions and self.permission(tool) is not Permission.DENY
