"""Durable runs, the worker's side: a run's journal found, opened, and written fenced.

A Claude run's context is read with its user's live journal (:mod:`vigil.ledger.journal`).
Before the agent starts, :func:`open_run` reads what else the decision needs, has
:func:`vigil.agent.journal.decide` (pure) say what the run is, and carries it out:

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
  steps back instead (``Opened.steps_back``, nothing counted): that attempt is due alone at
  once (the run in progress is at its user's turn) and replays the journal with nothing in flight.
- **A journal it cannot replay** (its events are gone): dropped, fenced, and the run starts
  over under a new key.
- **A batch's journal on its first event's lone last attempt** (claim rule 3): replayed
  whole, alone, once and uncounted (a batch lost only in company keeps its keys); stamped
  so, a journal that comes back crashed by itself: dropped, and the first event runs alone.

Runs and background tasks both get their journal from :func:`open_journal`: a key, where its
steps go (a :class:`vigil.agent.journal.Writer` fenced by a
:class:`vigil.ledger.journal.Fence`: a claim's epoch or a task's lease), the steps a replay
takes, and when to stop at a step boundary.

With ``VIGIL_RUN_JOURNAL=false`` none of this happens: each claim's calls get keys of its own
(:func:`unjournaled_key`), and a crash repeats them under new ones. The worker refuses that
while its agent has tools that act, unless told to (:func:`refuse_unjournaled_actions`).

A run's steps are appended through the worker's :class:`GroupAppend` (many runs' steps in one
statement), a task's by :class:`FencedWriter` (a statement each); each append is fenced, and a
refused one raises ``Fenced``: the run stops as a failed attempt, whose finish is then refused
as stale (nothing of it lands).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from vigil.agent import metrics as agent_metrics
from vigil.agent.base import Agent, RunContext
from vigil.agent.journal import Decision, Found, Journal, Opening, Writer, decide, first_key, same_run
from vigil.errors import VigilError
from vigil.ledger import claims as ledger_claims
from vigil.ledger import journal as ledger_journal
from vigil.ledger.claims import Claim
from vigil.ledger.db import AsyncPool
from vigil.ledger.events import EventRow
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

    def __init__(self, pool: AsyncPool) -> None:
        self.pool = pool
        self._waiting: list[tuple[ledger_journal.Pending, asyncio.Future[None]]] = []
        self._writing: asyncio.Task[None] | None = None

    def writer(self, fence: ledger_journal.RunFence, run_key: str) -> Writer:
        """Where one run's steps go: into this group's statements, each under ``fence``."""
        return _Grouped(self, fence, run_key)

    async def put(self, item: ledger_journal.Pending) -> None:
        """Write ``item`` with the next group; raises ``Fenced`` when its fence refused it."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
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


# Steps per group statement: bounds its parameters (a few KB each) and its lock list.
GROUP_MAX = 500


@dataclass(frozen=True, slots=True)
class _Grouped:
    """One run's writer through its shard's :class:`GroupAppend`."""

    group: GroupAppend
    fence: ledger_journal.RunFence
    run_key: str

    async def append(self, step: int, kind: str, body: str) -> None:
        await self.group.put(ledger_journal.Pending(self.fence, self.run_key, step, kind, body))

    async def outcome(self, step: int, outcome: str) -> None:
        await self.group.put(ledger_journal.Pending(self.fence, self.run_key, step, "outcome", outcome))


@dataclass(frozen=True, slots=True)
class FencedWriter:
    """Appends one journal's steps, a statement each on a pooled connection (autocommit),
    fenced (:mod:`vigil.ledger.journal`, rule 2): a background task's, whose steps are few."""

    pool: AsyncPool
    fence: ledger_journal.Fence
    run_key: str

    async def append(self, step: int, kind: str, body: str) -> None:
        async with self.pool.connection() as conn:
            await ledger_journal.append(conn, self.fence, run_key=self.run_key, step=step, kind=kind, body=body)

    async def outcome(self, step: int, outcome: str) -> None:
        async with self.pool.connection() as conn:
            await ledger_journal.outcome(conn, self.fence, run_key=self.run_key, step=step, outcome=outcome)


def open_journal(
    run_key: str,
    writer: Writer | None,
    steps: Sequence[ledger_journal.Step] = (),
    stop: Callable[[], bool] | None = None,
) -> Journal:
    """A run's or a task's journal, the one way either is opened: keyed ``run_key``, its steps
    written by ``writer`` (None: nowhere, VIGIL_RUN_JOURNAL=false), replaying ``steps``, and
    stopping at its next step boundary once ``stop()`` says so (a hand-over)."""
    journal = Journal.of(run_key, writer, steps)
    journal.stop = stop
    return journal


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


@dataclass(frozen=True, slots=True)
class Opened:
    """What :func:`open_run` made of the claim: its opening, and the run's journal; none when
    the claim steps back (the caller releases it, nothing counted)."""

    opening: Opening
    journal: Journal | None

    @property
    def steps_back(self) -> bool:
        return self.journal is None


async def open_run(
    pool: AsyncPool,
    claim: Claim,
    ctx: RunContext,
    *,
    max_attempts: int,
    reload: Callable[[RunContext], Awaitable[None]],
    folded: list[EventRow],
    stop: Callable[[], bool],
    group: GroupAppend | None = None,
) -> Opened:
    """Open the run's journal against its user's live one (``ctx.found``, read with the
    context), in order: read what the decision needs (the run in progress's lone last attempt),
    :func:`vigil.agent.journal.decide`, take the journal's events up (claimed by id, or
    released: :func:`_take_up`; refused, the decision's fallback), drop the journal it cannot
    replay, then bind the run: its key, events, journal and ``adopt`` in ``ctx``, and for a
    replay whose taken-up events name sessions or approvals, its context read again
    (``reload``). A crash anywhere before the agent starts leaves the claim (and whatever was
    claimed by id under its epoch) to the heal or the next owner; the journal, untouched or
    dropped fenced, decides the same again."""
    live, ctx.found = pick(ctx.found or [], claim.run_key), None
    found = await _found(pool, claim, live, max_attempts)
    decision = decide(claim.run_key, claim.attempt, claim.event_ids, found, max_attempts)
    fence = ledger_journal.RunFence(claim.home, claim.epoch, claim.user_id, claim.attempt)
    adopted: list[EventRow] = []
    if decision.takes_up:
        taken = await _take_up(pool, claim, decision, max_attempts)
        if taken is None:
            assert decision.refused is not None  # a take-up always says what follows its refusal
            decision = decision.refused
        else:
            adopted = taken
    _report(decision, claim, live)
    if decision.opening is Opening.STEPPED_BACK:
        return Opened(decision.opening, None)
    if decision.drops_journal and live is not None:
        async with pool.connection() as conn:
            await ledger_journal.discard(conn, fence, live.run_key)
    writer = group.writer(fence, decision.run_key) if group is not None else FencedWriter(pool, fence, decision.run_key)
    steps = live.steps if decision.takes_up and live is not None else ()
    journal = open_journal(decision.run_key, writer, steps, stop)
    ctx.journal, ctx.run_key, ctx.events = journal, journal.run_key, list(claim.events)
    if ctx.delegation is not None:
        ctx.delegation = replace(ctx.delegation, owner_chain=(claim.user_id, journal.run_key))
    ctx.adopt = _adopter(pool, claim, folded, max_attempts)
    if decision.takes_up and (
        not same_run(decision.run_key, claim.run_key) or any(e.session_id or e.source == "approval" for e in adopted)
    ):
        await reload(ctx)
    return Opened(decision.opening, journal)


def pick(lives: Sequence[ledger_journal.Live], claim_key: str) -> ledger_journal.Live | None:
    """The live journal a claim opens against: its own run's, else the oldest (the user's run
    in progress, or a retried dead event's that waits its turn: :func:`decide` takes it up)."""
    return next((live for live in lives if same_run(live.run_key, claim_key)), lives[0] if lives else None)


async def _found(pool: AsyncPool, claim: Claim, live: ledger_journal.Live | None, max_attempts: int) -> Found | None:
    """The live journal as :func:`vigil.agent.journal.decide` takes it: with its start, and
    for another run's journal, whether its first event is due its lone last attempt."""
    if live is None:
        return None
    start = _start_of(live)
    lone = False
    if start is not None and not same_run(live.run_key, claim.run_key):
        async with pool.connection() as conn:
            lone = await ledger_claims.due_alone(conn, start[0], max_attempts)
    return Found(live.run_key, tuple(start) if start is not None else None, live.alone, lone)


def _report(decision: Decision, claim: Claim, live: ledger_journal.Live | None) -> None:
    """The decision in the replay metric and the log (a fresh run is neither)."""
    if decision.opening is Opening.FRESH or live is None:
        return
    agent_metrics.RUN_REPLAYS.labels(decision.opening.value).inc()
    steps, events = len(live.steps), len(decision.start)
    if decision.opening is Opening.REPLAYED:
        log.info("replaying the run's journal (%d steps, %d events)", steps, events)
    elif decision.opening is Opening.ALONE:
        log.warning(
            "replaying the run's journal (%d steps, %d events), alone on its first event's last attempt, "
            "the attempt given back",
            steps,
            events,
        )
    elif decision.opening is Opening.ISOLATED:
        # The batch crashed with nothing else in flight (its replay alone did): its first
        # event's last attempt runs alone afresh. Taking the batch up again would spend the
        # batch-mates' last attempt on a crash that may be another event's.
        log.warning("not replaying a journal that crashed alone: event %d runs alone", claim.events[0].id)
    elif decision.opening is Opening.STEPPED_BACK:
        # Dropping the run in progress's journal would make its calls again under new keys.
        log.warning("the user's run in progress (%s) is due its lone last attempt: this claim steps back", live.run_key)
    else:
        log.warning("dropping a journal its run cannot replay (%d steps of %s)", steps, live.run_key)


def fresh_key(claim: Claim) -> str:
    """A fresh run's key (:func:`vigil.agent.journal.first_key`)."""
    return first_key(claim.run_key, claim.attempt)


def _start_of(live: ledger_journal.Live) -> list[int] | None:
    """The events the journaled run started with (its step 1), or None if it has none."""
    if not live.steps or live.steps[0].step != 1:
        return None
    start = Journal.of(live.run_key, None, live.steps[:1]).start
    return list(start["events"]) if start and isinstance(start.get("events"), list) else None


async def _take_up(pool: AsyncPool, claim: Claim, decision: Decision, max_attempts: int) -> list[EventRow] | None:
    """Make the claim cover exactly the journal's start events: claim the missing ones by id,
    release those that came since. Returns the events claimed by id; None (nothing changed)
    if a start event cannot be claimed. For the lone last attempt's batch replay
    (``Opening.ALONE``): :func:`_take_up_alone`."""
    start = list(decision.start)
    have = {event.id: event for event in claim.events}
    missing = [i for i in start if i not in have]
    extra = [event.id for event in claim.events if event.id not in set(start)]
    async with pool.connection() as conn:
        adopted: list[EventRow] | None
        if decision.opening is Opening.ALONE:
            adopted = await _take_up_alone(conn, claim, decision.run_key, missing, max_attempts)
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


class _NotAlone(VigilError):
    """The batch cannot be taken up alone: the transaction that tried rolls back."""


async def _take_up_alone(
    conn: AsyncConnection[DictRow], claim: Claim, run_key: str, missing: list[int], max_attempts: int
) -> list[EventRow] | None:
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


def _adopter(
    pool: AsyncPool, claim: Claim, folded: list[EventRow], max_attempts: int
) -> Callable[[Sequence[int]], Awaitable[list[EventRow]]]:
    """ctx.adopt: a replayed boundary's events, claimed by id and folded into the run."""

    async def adopt(ids: Sequence[int]) -> list[EventRow]:
        async with pool.connection() as conn:
            more = await ledger_claims.claim_ids(conn, claim, ids, max_attempts)
        folded.extend(more)
        return more

    return adopt
