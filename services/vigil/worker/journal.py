"""Durable runs, the worker's side: a run's journal found, taken up, and written fenced.

A Claude run's context is read with its user's live journal (:mod:`vigil.ledger.journal`).
Before the agent starts, :func:`prepare` decides what the run is:

- **No journal**: a fresh run. Its key is ``<user>:<first event id>`` on a first attempt; a
  later attempt with no journal adds ``~<attempt>`` (an earlier attempt wrote nothing, so no
  tool ever saw a key of it; and a journal dropped as unreplayable never lends its keys to
  other calls).
- **A journal of this run** (same user and first event): a **replay**. The run covers the
  events the journal started with, in that order: those the claim did not bring are claimed
  by id under the claim's epoch (a crash's retry claims the first event alone, rule 3), and
  those it brought that the journal did not start with are released (they came meanwhile:
  the fold policy meets them at the first live boundary, or they wait for the next run).
  The agent then takes journaled answers and outcomes instead of asking and acting again.
- **Another run's journal** (the user's run in progress, which an operator's retry of an
  older dead event overtook): that run goes first, taken up with its events, this claim's
  released. If its first event's next attempt is a lone last attempt (claim rule 3), the claim
  steps back instead (:class:`StepsBack`, nothing counted): that attempt is due alone at once
  (the run in progress is at its user's turn) and replays the journal with nothing in flight.
- **A journal it cannot replay** (its events are gone): dropped, fenced, and the run starts
  over under a new key.
- **A batch's journal on its first event's lone last attempt** (claim rule 3): replayed
  whole, alone, once and uncounted (a batch lost only in company keeps its keys); stamped
  so, a journal that comes back crashed by itself: dropped, and the first event runs alone.

With ``VIGIL_RUN_JOURNAL=false`` none of this happens: each claim's calls get keys of its own
(:func:`unjournaled_key`), and a crash repeats them under new ones. The worker refuses that
while its agent has tools that act, unless told to (:func:`refuse_unjournaled_actions`).

:class:`RunWriter` appends a run's steps, each on a pooled connection in its own statement
(autocommit), fenced by the claim's epoch; a refused append raises ``Fenced`` and the run
stops as a failed attempt, whose finish is then refused as stale (nothing of it lands).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import replace

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from vigil.agent import metrics as agent_metrics
from vigil.agent.base import Agent, RunContext
from vigil.agent.journal import HandedOver, Journal
from vigil.ledger import claims as ledger_claims
from vigil.ledger import journal as ledger_journal
from vigil.ledger.claims import Claim
from vigil.ledger.db import AsyncPool
from vigil.settings import SettingsError
from vigil.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class GroupAppend:
    """Every run's appends and outcomes, written together: whatever is waiting when the
    previous statement returns goes in the next one (a group commit, as the finish has).

    A statement per step cost a pooled connection and a round trip each: with 2,500
    model-bound runs in flight that was about half a millisecond of worker CPU per step. A
    step waits for its group's statement (milliseconds, beside a model call's seconds); each
    still stands or is refused by its own fence. If the statement fails, every step of the
    group fails with it (the runs fail as attempts, as a single append's failure did)."""

    def __init__(self, pool: AsyncPool):
        self.pool = pool
        self._waiting: list[tuple[ledger_journal.Pending, asyncio.Future]] = []
        self._writing: asyncio.Task | None = None

    async def put(self, item: ledger_journal.Pending) -> None:
        """Write ``item`` with the next group; raises ``Fenced`` when its fence refused it."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((item, done))
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._write(), name="journal-group-append")
        await done

    async def _write(self) -> None:
        while self._waiting:
            group, self._waiting = self._waiting[:GROUP_MAX], self._waiting[GROUP_MAX:]
            appends = [i for i, _ in group if i.kind != "outcome"]
            outcomes = [i for i, _ in group if i.kind == "outcome"]
            try:
                async with self.pool.connection() as conn:
                    written = await ledger_journal.append_many(conn, appends) if appends else set()
                    written |= await ledger_journal.outcome_many(conn, outcomes) if outcomes else set()
            except Exception as exc:  # the group's statement failed: so did each of its steps
                for _, done in group:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for item, done in group:
                if done.done():
                    continue
                if (item.run_key, item.step) in written:
                    done.set_result(None)
                else:
                    done.set_exception(
                        ledger_journal.Fenced(f"journal {item.kind} of step {item.step} of {item.run_key} refused")
                    )


class StepsBack(HandedOver):
    """The claim found the user's run in progress (another run's journal) due its lone last
    attempt: it is released, nothing counted, so that attempt runs alone first (claim rule 3)."""


# Steps per group statement: bounds its parameters (a few KB each) and its lock list.
GROUP_MAX = 500


class RunWriter:
    """Appends one run's steps, fenced (:mod:`vigil.ledger.journal`, rule 2): through the
    worker's :class:`GroupAppend` when it has one, else a statement per step (a task's)."""

    def __init__(
        self,
        pool: AsyncPool,
        fence: ledger_journal.RunFence | ledger_journal.TaskFence,
        run_key: str,
        group: GroupAppend | None = None,
    ):
        self.pool = pool
        self.fence = fence
        self.run_key = run_key
        self.group = group  # a task's steps (TaskFence) are few: a statement each

    async def append(self, step: int, kind: str, body: str) -> None:
        if self.group is not None and isinstance(self.fence, ledger_journal.RunFence):
            await self.group.put(ledger_journal.Pending(self.fence, self.run_key, step, kind, body))
            return
        async with self.pool.connection() as conn:
            await ledger_journal.append(conn, self.fence, run_key=self.run_key, step=step, kind=kind, body=body)

    async def outcome(self, step: int, outcome: str) -> None:
        if self.group is not None and isinstance(self.fence, ledger_journal.RunFence):
            await self.group.put(ledger_journal.Pending(self.fence, self.run_key, step, "outcome", outcome))
            return
        async with self.pool.connection() as conn:
            await ledger_journal.outcome(conn, self.fence, run_key=self.run_key, step=step, outcome=outcome)


def refuse_unjournaled_actions(settings: WorkerSettings, agent: Agent) -> None:
    """Without a journal a crash repeats every action call of the attempt it cut short, under
    a new key the acted-on system cannot match: a worker whose agent has tools that act does
    not start so unless the operator said so (VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS=accept).
    Raises SettingsError naming the settings and the tools."""
    if settings.run_journal or settings.run_journal_off_with_actions == "accept":
        return
    acting = agent.acting_tools()
    if acting:
        raise SettingsError(
            "VIGIL_RUN_JOURNAL=false: a retried run or task would repeat the calls of these tools, which act "
            f"on the world, under new idempotency keys: {', '.join(acting)}. Turn the journal on, remove the "
            "tools (a denied tool still counts: a profile may allow it), or set "
            "VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS=accept"
        )


def unjournaled_key(claim: Claim) -> str:
    """A run's key without a journal (VIGIL_RUN_JOURNAL=false): its claim's own,
    ``<run key>~<attempt>.<8 random hex digits>``. The attempt alone is not enough: a claim
    released without counting one (an overloaded model, a hand-over, the drain before a lone
    last attempt) is claimed again at the same attempt, asks the model again, and may make
    other calls at the same steps."""
    return f"{claim.run_key}~{claim.attempt}.{secrets.token_hex(4)}"


def fresh_key(claim: Claim) -> str:
    return claim.run_key if claim.attempt <= 1 else f"{claim.run_key}~{claim.attempt}"


async def prepare(
    pool: AsyncPool,
    claim: Claim,
    ctx: RunContext,
    live: ledger_journal.Live | None,
    reload: Callable[[RunContext], Awaitable[None]],
    max_attempts: int,
    group: GroupAppend | None = None,
) -> Journal:
    """Decide whether the run is fresh or a replay (module doc), set ``ctx`` (its key, its
    events, its journal) and, for a replay, the claim's events. ``reload``: reads the run's
    context again, for a replay whose taken-up events name sessions or approvals the context
    was read without. Returns the run's journal."""
    fence = ledger_journal.RunFence(claim.home, claim.epoch, claim.user_id, claim.attempt)
    start = _start_of(live)
    this_run = live is not None and _is_this_run(live.run_key, claim)
    if live is not None and start is not None and (this_run or claim.attempt < max_attempts):
        # Another run's journal (the user's run in progress, which an operator's retry of an
        # older dead event overtook): that run goes first, this claim's events go back.
        isolates = this_run and _isolates(claim, start, max_attempts)
        if not isolates:
            adopted = await _take_up(pool, claim, start, max_attempts)
        elif not live.alone:
            # Claim rule 3's lone last attempt, of a batch that lost its worker only in company
            # so far: the whole batch replays once with nothing else in flight, uncounted.
            # Splitting it now would make its calls again under new keys for another run's crash.
            adopted = await _take_up(pool, claim, start, max_attempts, alone=live.run_key)
        else:
            adopted = None
        if adopted is not None:
            reason = "alone" if isolates else "replayed"
            agent_metrics.RUN_REPLAYS.labels(reason).inc()
            log.log(
                logging.WARNING if isolates else logging.INFO,
                "replaying the run's journal (%d steps, %d events)%s",
                len(live.steps),
                len(start),
                ", alone on its first event's last attempt, the attempt given back" if isolates else "",
            )
            journal = Journal.of(live.run_key, RunWriter(pool, fence, live.run_key, group), live.steps)
            if not this_run or any(e.session_id or e.source == "approval" for e in adopted):
                ctx.events = list(claim.events)
                await reload(ctx)
            return _bind(ctx, claim, journal)
        if isolates:
            # The batch crashed with nothing else in flight (its replay alone did): its first
            # event's last attempt runs alone afresh. Taking the batch up again would spend the
            # batch-mates' last attempt on a crash that may be another event's: the poison
            # would take them down with it.
            agent_metrics.RUN_REPLAYS.labels("isolated").inc()
            log.warning(
                "not replaying a journal of %d events that crashed alone: event %d runs alone",
                len(start),
                claim.events[0].id,
            )
            async with pool.connection() as conn:
                await ledger_journal.discard(conn, fence, live.run_key)
            key = f"{claim.run_key}~{claim.attempt}"
            return _bind(ctx, claim, Journal(key, RunWriter(pool, fence, key, group)))
    if live is not None and start is not None and not this_run:
        async with pool.connection() as conn:
            lone = await ledger_claims.due_alone(conn, start[0], max_attempts)
        if lone:
            # The run in progress cannot be taken up here (its first event's last attempt runs
            # alone): dropping its journal would make its calls again under new keys.
            agent_metrics.RUN_REPLAYS.labels("stepped_back").inc()
            log.warning(
                "the user's run in progress (%s) is due its lone last attempt: this claim steps back", live.run_key
            )
            raise StepsBack(f"{live.run_key} goes first, alone")
    if live is not None:
        agent_metrics.RUN_REPLAYS.labels("discarded").inc()
        log.warning("dropping a journal its run cannot replay (%d steps of %s)", len(live.steps), live.run_key)
        async with pool.connection() as conn:
            await ledger_journal.discard(conn, fence, live.run_key)
        key = f"{claim.run_key}~{claim.attempt}"
    else:
        key = fresh_key(claim)
    return _bind(ctx, claim, Journal(key, RunWriter(pool, fence, key, group)))


def _bind(ctx: RunContext, claim: Claim, journal: Journal) -> Journal:
    ctx.journal = journal
    ctx.run_key = journal.run_key
    ctx.events = list(claim.events)
    if ctx.delegation is not None:
        ctx.delegation = replace(ctx.delegation, owner_chain=(claim.user_id, journal.run_key))
    return journal


def _isolates(claim: Claim, start: list[int], max_attempts: int) -> bool:
    """Is this claim the lone last attempt of a run that started with other events?"""
    return claim.attempt >= max_attempts and start != claim.event_ids


def _is_this_run(run_key: str, claim: Claim) -> bool:
    return run_key == claim.run_key or run_key.startswith(claim.run_key + "~")


def _start_of(live: ledger_journal.Live | None) -> list[int] | None:
    """The events the journaled run started with (its step 1), or None if it has none."""
    if live is None or not live.steps or live.steps[0].step != 1:
        return None
    journal = Journal.of(live.run_key, None, live.steps[:1])
    start = journal.start
    return list(start["events"]) if start and isinstance(start.get("events"), list) else None


async def _take_up(
    pool: AsyncPool,
    claim: Claim,
    start: list[int],
    max_attempts: int,
    alone: str | None = None,
) -> list | None:
    """Make the claim cover exactly the journal's start events: claim the missing ones by id,
    release those that came since. Returns the events claimed by id; None (nothing changed)
    if a start event cannot be claimed. ``alone``: the journal's key, for the lone last
    attempt's batch replay (:func:`_take_up_alone`)."""
    have = {event.id: event for event in claim.events}
    missing = [i for i in start if i not in have]
    extra = [event.id for event in claim.events if event.id not in set(start)]
    async with pool.connection() as conn:
        if alone is not None:
            adopted = await _take_up_alone(conn, claim, alone, missing, max_attempts)
            if adopted is None:
                return None
        else:
            adopted = await ledger_claims.claim_ids(conn, claim, missing, max_attempts) if missing else []
            if len(adopted) != len(missing):
                if adopted:
                    await ledger_claims.release_claim(conn, claim.home, claim.epoch, [e.id for e in adopted])
                return None
        if extra:
            await ledger_claims.release_claim(conn, claim.home, claim.epoch, extra)
    have.update({event.id: event for event in adopted})
    claim.events[:] = [have[i] for i in start]
    return adopted


class _NotAlone(Exception):
    """The batch cannot be taken up alone: the transaction that tried rolls back."""


async def _take_up_alone(
    conn: AsyncConnection[DictRow], claim: Claim, run_key: str, missing: list[int], max_attempts: int
) -> list | None:
    """The batch replayed alone on its lead's last attempt, in one transaction: its journal
    stamped (once: a stamped journal that comes back crashed alone), the batch-mates claimed
    and the lead's attempt given back, uncounted. None (nothing changed) if any fails."""
    fence = ledger_journal.RunFence(claim.home, claim.epoch, claim.user_id, claim.attempt)
    try:
        async with conn.transaction():
            if not await ledger_journal.mark_alone(conn, fence, run_key):
                raise _NotAlone
            adopted = await ledger_claims.claim_ids_alone(conn, claim, missing, max_attempts)
            if len(adopted) != len(missing):
                raise _NotAlone
    except _NotAlone:
        return None
    return adopted


def adopter(pool: AsyncPool, claim: Claim, folded: list, max_attempts: int):
    """ctx.adopt: a replayed boundary's events, claimed by id and folded into the run."""

    async def adopt(ids):
        async with pool.connection() as conn:
            more = await ledger_claims.claim_ids(conn, claim, ids, max_attempts)
        folded.extend(more)
        return more

    return adopt
