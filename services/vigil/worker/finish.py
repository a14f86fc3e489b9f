"""The finish: one fenced transaction per group of finished runs.

Order inside the transaction:

1. Lock every involved partition row ``FOR SHARE`` and read its epoch (:func:`vigil.ledger.partitions.lock_epochs`). A
   run whose claim epoch is no longer current is *stale*: nothing of it is written, it is
   counted, and its events stay with the new owner, who handed them back at takeover.
2. For all current runs at once (``finish_runs``, one statement): their ``runs`` rows (none
   for a run refused for its user's daily budget: it never started), the
   done runs' events and their outbox rows. Then, for runs that have them: a failed
   attempt's events back to ``pending`` with the error and a backoff, timers, approval
   requests, memory writes and delegated background tasks (a run that does not commit
   starts nothing); and, in one statement for the group, the session and
   deadline of each message that has them (``outbox_tag_messages``), the journals of the done
   runs that kept one (deleted, or kept as finished: ``journal_finish_users``), and the
   sessions the runs saved (``agent_sessions_save_many``). A failed attempt keeps its
   journal: the retry replays it.
3. Commit.

A crash before the commit leaves every claim ``running``: the next owner of the partition
hands them back and they are retried (at-least-once execution). A crash after it leaves
nothing to redo. Several runs share one transaction (group commit) because the ledger is
the shared bottleneck; if any run's events do not match its claim (which fencing makes a
bug, not a race), the group is rolled back and each run is committed on its own, so one
bad run cannot refuse its neighbours.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil.agent.base import NewTask, OverBudget, RunResult
from vigil.agent.run_ledger import session_rows
from vigil.errors import VigilError
from vigil.ledger import agent as ledger_agent
from vigil.ledger import approvals as ledger_approvals
from vigil.ledger import budgets as ledger_budgets
from vigil.ledger import db
from vigil.ledger import finish as ledger_finish
from vigil.ledger import journal as ledger_journal
from vigil.ledger import partitions as ledger_partitions
from vigil.ledger import tasks as ledger_tasks
from vigil.ledger.claims import Claim
from vigil.ledger.events import EventRow
from vigil.ledger.states import RunOutcome
from vigil.retry import backoff
from vigil.worker import metrics

log = logging.getLogger(__name__)


class FinishMismatch(VigilError):
    """A run's events were not all ``running`` under its epoch: refuse the run."""


@dataclass(slots=True)
class Finished:
    """A run's outcome waiting to be committed."""

    claim: Claim
    started_at: datetime
    result: RunResult | None = None
    error: str | None = None  # set for a failed attempt
    transient: bool = False  # model API overload: give the attempt back
    waiting: bool = False  # the user's daily token budget is spent: not started, wait, count nothing
    backoff_s: float = 0.0
    folded: list[EventRow] = field(default_factory=list)  # claimed mid-run
    journaled: bool = False  # the run kept a journal (vigil.worker.journal): its finish ends it

    @property
    def event_ids(self) -> list[int]:
        return self.claim.event_ids + [event.id for event in self.folded]

    @property
    def outcome(self) -> RunOutcome:
        return self.result.outcome if self.error is None and self.result else RunOutcome.FAILED


def stopped_by_budget(finished: Finished, exc: OverBudget) -> Finished:
    """``finished``, a run the user's daily token budget stopped before its first model call
    (the agent's :class:`OverBudget`), as it is committed: not started, so no runs row, no
    attempt of any kind counted, the journal kept, and its events wait until the next UTC day
    (``exc.retry_after``) with the reason (``ledger_budgets.WAITING_PREFIX``), where the daily
    release finds them. Never done: no run processed them (stored done with outcome
    ``nothing``, they were lost; 2fd0780). The ledger's model drives this (tests/test_ledger_model.py)."""
    finished.result = None
    finished.error = f"{ledger_budgets.WAITING_PREFIX}{exc.reason}"
    finished.waiting = True
    finished.transient = False
    finished.backoff_s = exc.retry_after or 0.0
    return finished


def run_record(run: Finished) -> ledger_finish.RunRecord:
    """The run as finish_runs writes it."""
    claim, result = run.claim, run.result
    usage = result.usage if result else None
    session = result.session if result else None
    done = run.error is None and result is not None
    return ledger_finish.RunRecord(
        user_id=claim.user_id,
        home=claim.home,
        epoch=claim.epoch,
        event_ids=run.event_ids,
        started_at=run.started_at,
        outcome=run.outcome,
        done=done,
        session_id=session.id if session else None,
        error=run.error,
        turns=usage.turns if usage else 0,
        input_tokens=usage.input_tokens if usage else 0,
        output_tokens=usage.output_tokens if usage else 0,
        cache_read_tokens=usage.cache_read_tokens if usage else 0,
        cache_write_tokens=usage.cache_write_tokens if usage else 0,
        tool_calls=usage.tool_calls if usage else 0,
        profile=result.profile[0] if result and result.profile else None,
        profile_version=result.profile[1] if result and result.profile else None,
        messages=[ledger_finish.RunMessage(m.text, m.urgent) for m in result.messages] if done and result else [],
        traceparent=claim.traceparent,
    )


def _has_more(run: Finished) -> bool:
    """Does the run write anything besides its row, its done events and its messages?"""
    if run.error is not None:
        return True
    result = run.result
    return result is not None and bool(result.timers or result.approvals or result.memory_writes or result.tasks)


async def _write_more(
    conn: psycopg.AsyncConnection[DictRow], run: Finished, run_id: int | None, now: datetime | None
) -> list[tuple[psycopg.AsyncCursor[DictRow], int]]:
    """Queue a run's other writes (pipeline mode); return (cursor, expected rowcount) checks.
    ``now``: the finisher's clock, from which a failure's backoff and a task's deadline count.
    ``run_id``: None for a run refused for its budget (it has no row)."""
    claim = run.claim
    if run.error is not None:
        ids = run.event_ids
        cur = await ledger_finish.finish_failed(
            conn,
            ids=ids,
            epoch=claim.epoch,
            run_id=run_id,
            error=run.error[:2000],
            backoff_s=run.backoff_s,
            transient=run.transient,
            waiting=run.waiting,
            now=now,
        )
        return [(cur, len(ids))]
    result = run.result
    assert result is not None
    user = claim.user_id
    for timer in result.timers:
        await ledger_finish.insert_timer(
            conn,
            user_id=user,
            timer_id=timer.id,
            kind=timer.kind,
            due=timer.due,
            catch_up=timer.catch_up,
            payload=timer.payload,
            fixed_key=timer.fixed_key,
            run_id=run_id,
            traceparent=claim.traceparent,
        )
    for approval in result.approvals:
        await ledger_approvals.create(
            conn,
            request_id=approval.request_id,
            user_id=user,
            session_id=approval.session_id,
            run_id=run_id,
            tool=approval.tool,
            tool_use_id=approval.tool_use_id,
            args_hash=approval.args_hash,
            due=approval.due,
            on_expiry=approval.on_expiry,
        )
    for write in result.memory_writes:
        await ledger_finish.write_memory(conn, user_id=user, path=write.path, content=write.content, run_id=run_id)
    for task in result.tasks:
        await ledger_tasks.create(conn, new_task_row(user, task, run_id, result.profile), now=now)
    return []


def new_task_row(
    user_id: str, task: NewTask, run_id: int | None = None, profile: tuple[str, int] | None = None
) -> ledger_tasks.NewTaskRow:
    """The task's row; ``profile``: the delegating run's version, which the task runs with."""
    name, version = profile or (None, None)
    return ledger_tasks.NewTaskRow(
        id=task.id,
        user_id=user_id,
        parent_run_key=task.parent_run_key,
        parent_task_id=task.parent_task_id,
        session_id=task.session_id,
        depth=task.depth,
        owner_chain=list(task.owner_chain),
        instructions=task.instructions,
        tools=list(task.tools),
        token_budget=task.token_budget,
        max_attempts=task.max_attempts,
        timeout_s=task.timeout_s,
        run_id=run_id,
        profile=name,
        profile_version=version,
        max_open=task.max_open,
    )


async def _commit(
    conn: psycopg.AsyncConnection[DictRow],
    runs: list[Finished],
    worker: str,
    journal_keep: bool = False,
    now: datetime | None = None,
) -> tuple[list[Finished], list[Finished]]:
    """One transaction for ``runs``. Returns (committed, stale). Raises FinishMismatch.

    Whatever the group's size: one statement locks the epochs, one (``finish_runs``) writes
    every run's row, done events and messages; only runs with more to write (failures,
    timers, approvals, memory, sessions) add statements, pipelined.
    """
    homes = sorted({run.claim.home for run in runs})
    # Round trips: BEGIN with the epochs' lock, then finish_runs, then (only for runs with
    # more to write) their statements checked, then the sessions, the tags and the COMMIT
    # together: three for a group of plain runs, where a statement at a time took five.
    async with db.pipelined_transaction(conn) as pipeline:
        current = await ledger_partitions.lock_epochs(conn, homes)
        valid: list[Finished] = []
        stale: list[Finished] = []
        for r in runs:  # one pass: `r in valid` would compare whole dataclasses, O(n^2) per group
            fresh = current.get(r.claim.home) == r.claim.epoch
            (valid if fresh else stale).append(r)
        if valid:
            # finish_runs matches a run's messages to it by user: one run per user per group,
            # which the runner guarantees (a user's next claim waits for this commit).
            assert len({r.claim.user_id for r in valid}) == len(valid), "two runs of one user in one finish"
            # A run refused for its user's daily budget was never started: no runs row.
            records = [run_record(r) for r in valid if not r.waiting]
            ids = await ledger_finish.finish_runs(conn, records, worker) if records else {}
            for run in valid:
                if run.error is None and (done := ids[run.claim.user_id].done) != len(run.event_ids):
                    raise FinishMismatch(f"{done} of {len(run.event_ids)} events still claimed")
            checks: list[tuple[psycopg.AsyncCursor[DictRow], int]] = []
            for run in valid:
                if _has_more(run):
                    run_id = None if run.waiting else ids[run.claim.user_id].run_id
                    checks.extend(await _write_more(conn, run, run_id, now))
            if checks:
                await pipeline.sync()  # their row counts, before anything commits
            for cursor, expected in checks:
                if cursor.rowcount != expected:
                    raise FinishMismatch(f"{cursor.rowcount} of {expected} events still claimed")
            # A run that waits for its budget keeps its journal: its events come back to it.
            ended = [r for r in valid if r.journaled and r.error is None and not r.waiting]
            await ledger_journal.finish_users(
                conn,
                [r.claim.user_id for r in ended],
                [event_id for r in ended for event_id in r.event_ids],
                keep=journal_keep,
            )
            await ledger_agent.save_sessions(conn, _sessions(valid))
            await ledger_agent.tag_messages(conn, _message_tags(valid, ids))
    return valid, stale


def _sessions(runs: list[Finished]) -> list[ledger_agent.SessionRow]:
    """Every session the group's done runs saved (one statement for the group)."""
    return [
        row
        for run in runs
        if run.error is None and run.result is not None
        for row in session_rows(run.claim.user_id, run.result)
    ]


def _message_tags(runs: list[Finished], ids: dict[str, ledger_finish.RunWritten]) -> list[ledger_agent.MessageTag]:
    """Each message's session and deadline, by its run and its position among the run's
    messages (the order finish_runs inserted them in)."""
    tags = []
    for run in runs:
        if run.error is not None or run.result is None:
            continue
        for n, message in enumerate(run.result.messages, 1):
            if message.session_id is None and message.deadline is None:
                continue
            run_id = ids[run.claim.user_id].run_id
            tags.append(ledger_agent.MessageTag(run_id, n, message.session_id, message.deadline, message.actions))
    return tags


# What the ledger refuses about a run's *result* (a constraint it violates, a value it cannot
# store) is that run's fault, not the database's: retrying the same commit would loop forever.
REFUSED_RESULT = (psycopg.errors.IntegrityError, psycopg.errors.DataError)


async def commit_finished(
    conn: psycopg.AsyncConnection[DictRow],
    runs: list[Finished],
    worker: str,
    journal_keep: bool = False,
    *,
    now: datetime | None = None,
) -> tuple[list[Finished], list[Finished]]:
    """Commit a group of finished runs (group commit, per-run fallback). Returns (committed, stale).

    A run whose result the ledger refuses is committed as a failed attempt instead (its
    events back to pending with the reason), so it ends dead after the attempt bound rather
    than blocking every finish behind it.
    """
    try:
        committed, stale = await _commit(conn, runs, worker, journal_keep, now)
    except (FinishMismatch, *REFUSED_RESULT):
        committed, stale = [], []
        for run in runs:
            try:
                ok, refused = await _commit(conn, [run], worker, journal_keep, now)
            except FinishMismatch as exc:
                log.error(
                    "finish of %d event(s) refused: %s", len(run.event_ids), exc, extra={"event": "finish_refused"}
                )
                ok, refused = [], [run]
            except REFUSED_RESULT as exc:
                log.error(
                    "the ledger refused a run's result; recording a failed attempt: %s",
                    exc,
                    extra={"event": "result_refused"},
                )
                run.result, run.error = None, f"finish refused by the ledger: {type(exc).__name__}: {exc}"[:2000]
                run.backoff_s = backoff(run.claim.attempt, 1.0, 60.0)
                ok, refused = await _commit(conn, [run], worker, journal_keep, now)
            committed += ok
            stale += refused
    metrics.FINISH_BATCH.observe(len(runs))
    if stale:
        metrics.STALE_FINISHES.inc(len(stale))
        for run in stale:
            log.warning(
                "stale finish refused: claim at epoch %d of partition %d is no longer current (%d events)",
                run.claim.epoch,
                run.claim.home.partition,
                len(run.event_ids),
                extra={
                    "event": "stale_finish",
                    "user_id": run.claim.user_id,
                    "partition": run.claim.home.partition,
                    "epoch": run.claim.epoch,
                },
            )
    return committed, stale
