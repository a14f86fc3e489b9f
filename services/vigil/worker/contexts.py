"""A run's context: what the agent reads of the ledger before it runs (docs/worker.md, "Running").

:class:`Contexts` makes each run's :class:`vigil.agent.base.RunContext` (its events, deadline,
folds, delegation bounds and task door) and reads its session, memory and past messages
(:mod:`vigil.agent.run_ledger`): a claim pass's runs together on the claim's connection
(:meth:`Contexts.preload`), or a run alone on its shard's pool when that failed
(:meth:`Contexts.load`). :class:`vigil.worker.runs.Runs` asks it for each run's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import psycopg
from psycopg.rows import DictRow

from vigil.agent.base import Agent, Delegation, RunContext
from vigil.agent.run_ledger import load_context_parts, load_contexts
from vigil.clock import Clock, utc
from vigil.ledger.claims import Claim, claim_more
from vigil.ledger.db import AsyncPool
from vigil.ledger.events import EventRow
from vigil.worker import journal as run_journal
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import Shards

log = logging.getLogger(__name__)

# For an agent that does not say how many past messages it wants (``agent.recent_messages``):
# enough for it not to repeat itself, small enough for the prompt.
RECENT_MESSAGES = 20


class Contexts:
    """Each run's context: read with its claim pass, or by the run itself."""

    def __init__(self, settings: WorkerSettings, agent: Agent, shards: Shards, clock: Clock) -> None:
        self.settings = settings
        self.agent = agent
        self.shards = shards  # a run's context is read on its claim's shard
        self.clock = clock

    @property
    def needs_context(self) -> bool:
        """False for an agent that reads no session, memory or messages (the echo agent)."""
        return getattr(self.agent, "needs_context", True)

    async def preload(
        self, conn: psycopg.AsyncConnection[DictRow], started: list[tuple[Claim, list[EventRow]]]
    ) -> list[RunContext] | None:
        """The contexts of a pass's runs, read together: one pipeline on the claim's
        connection instead of a pooled connection and round trips per run. If that fails,
        each run reads its own (and fails as an attempt if it cannot either): the claims are
        committed already, so the pass must still start their runs."""
        ctxs = [self._new_context(claim, folded) for claim, folded in started]
        try:
            await load_contexts(conn, ctxs, self._recent_limit, self.journaled)
        except psycopg.Error as exc:
            log.warning("could not read %d runs' context together; each run reads its own: %s", len(ctxs), exc)
            return None
        return ctxs

    async def load(self, claim: Claim, folded: list[EventRow]) -> RunContext:
        """A run's context read on its own (not preloaded with its pass), on its claim's shard."""
        ctx = self._new_context(claim, folded)
        if self.needs_context:
            async with self.shards.pool_of(claim.home.partition).connection() as conn:
                await load_context_parts(conn, ctx, self._recent_limit, self.journaled)
        return ctx

    @property
    def journaled(self) -> bool:
        """Whether runs keep a journal: a Claude run does (VIGIL_RUN_JOURNAL); the echo agent
        has no model or tool step to journal."""
        return self.needs_context and self.settings.run_journal

    async def reload(self, pool: AsyncPool, ctx: RunContext) -> None:
        """A replay's context read again for its events (vigil.worker.journal.open_run), on its shard's ``pool``."""
        async with pool.connection() as conn:
            await load_context_parts(conn, ctx, self._recent_limit)

    @property
    def _recent_limit(self) -> int:
        """How many past messages the agent wants (VIGIL_RECENT_MESSAGES for the Claude agent)."""
        return getattr(self.agent, "recent_messages", RECENT_MESSAGES)

    def _new_context(self, c: Claim, folded: list[EventRow]) -> RunContext:
        """A run's context before anything is read: its events, its deadline, its folds
        (into ``folded``, the run's), its delegation bounds, its shard's task door."""

        async def fold(sources: Sequence[str], session_id: str | None = None) -> list[EventRow]:
            async with self.shards.pool_of(c.home.partition).connection() as conn:
                more = await claim_more(conn, c, sources, session_id)
            folded.extend(more)
            return more

        # Without a journal a retry asks the model again and may call other tools at the same
        # steps: each claim's calls get keys of its own (vigil.worker.journal.unjournaled_key),
        # never one a tool already saw for another call. With one, open_run sets the key. The
        # echo agent calls no tools.
        unjournaled = self.needs_context and not self.journaled
        run_key = run_journal.unjournaled_key(c) if unjournaled else run_journal.fresh_key(c)
        return RunContext(
            user_id=c.user_id,
            run_key=run_key,
            events=list(c.events),
            session=None,
            memory={},
            recent_messages=[],
            started_at=utc(self.clock.now()),
            # The host's clock, not ours: the agent checks this against time.monotonic(), and
            # asyncio enforces run_timeout_s on it too.
            deadline=time.monotonic() + self.settings.run_timeout_s,
            fold=fold,
            delegation=Delegation(
                depth=0,
                max_depth=self.settings.max_delegation_depth,
                token_budget=self.settings.task_token_budget,
                timeout_s=self.settings.task_timeout_s,
                max_attempts=self.settings.task_max_attempts,
                owner_chain=(c.user_id, run_key),
                max_tasks_per_run=self.settings.max_tasks_per_run,
                max_open_tasks_per_user=self.settings.max_open_tasks_per_user,
            ),
            tasks=self.shards.task_door(self.shards.shard_of(c.home.partition)),
        )
