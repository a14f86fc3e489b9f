"""The rebalance workload: a worker joins while another holds model-bound runs in flight.

One worker runs the Claude agent against the scripted Messages API (as the model-bound
workload does: every run waits on the model for seconds), every user has one chat message,
and once the worker's slots are full a second worker of the group starts. The cooperative
rebalance moves about half the partitions to it. What a rebalance costs is what happens to
the first worker's runs on the partitions that moved: with ``VIGIL_REVOKE_GRACE_S`` they
finish and commit, handed over (the new owner's takeover waits for them); cancelled instead,
they are released and run again on the new owner, their first model call thrown away.

Figures (no targets; the worker's defaults):

- ``rebalance_runs_finished_in_grace``: runs of the moved partitions that finished and
  committed during the revoke (``vigil_revoke_runs_finished_total``);
- ``rebalance_runs_released``: claims handed back to run again (``vigil_claims_released_total``);
- ``rebalance_revoke_s``: how long the revoke held the first worker's consumer, which records
  nothing meanwhile (``vigil_worker_revoke_seconds``; the whole grace until 468bf85, now the
  moment it takes to leave the hand-over in the ledger);
- ``rebalance_handover_s``: the hand-over on the first worker, from the revoke until the moved
  runs were gone (``vigil_worker_handover_seconds``);
- ``rebalance_takeover_wait_s``: how long the second worker's takeover waited for it
  (``vigil_worker_handover_wait_seconds``);
- ``rebalance_model_calls_per_run``: model calls made (both workers; answered or cut short by a
  cancel, ``vigil_model_requests_total``) per run; two is none thrown away;
- ``rebalance_moved_record_s``: once the hand-over has begun, new users each send a message;
  for those whose home partition moved, the seconds from produce to the ledger (median of
  the events, min and max beside it). Since c390748 the second worker records a partition
  being handed over at once; before, its takeover waited for the hand-over in its assignment
  callback and it recorded nothing until the moved runs were gone.

Then the same join again with ``VIGIL_REVOKE_GRACE_S=0`` (every run of a moved partition
cancelled at once), for what the grace buys: ``rebalance_runs_released_without_grace`` and
``rebalance_model_calls_per_run_without_grace``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import psycopg
from psycopg.rows import dict_row

from vigil_dev.bench import load
from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.model_bound import M, claude_stack, wait_finished
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.procs import START_TIMEOUT_S, ServiceDied
from vigil_dev.bench.stack import BenchStack

FIGURES = [
    "rebalance_runs_finished_in_grace",
    "rebalance_runs_released",
    "rebalance_revoke_s",
    "rebalance_handover_s",
    "rebalance_takeover_wait_s",
    "rebalance_model_calls_per_run",
    "rebalance_moved_record_s",
    "rebalance_runs_released_without_grace",
    "rebalance_model_calls_per_run_without_grace",
]
FULL_SHARE = 0.9  # the second worker starts once this share of the slots is busy


@dataclass(frozen=True)
class Size:
    users: int  # one chat message each
    concurrency: int  # the first worker's VIGIL_RUN_CONCURRENCY
    delay_s: float  # the model's mean answer delay
    spread_s: float  # each answer's delay drawn from delay_s +/- spread_s
    late: int  # new users sending a message once the hand-over has begun


SIZES = {
    # The model-bound workload's slots and answers, one wave and a half of users.
    "full": Size(users=4_000, concurrency=2_500, delay_s=5.0, spread_s=2.0, late=200),
    # Answers slow enough that runs are still in flight when the second worker is up.
    "quick": Size(users=100, concurrency=100, delay_s=5.0, spread_s=1.0, late=24),
}


@dataclass(frozen=True)
class Join:
    """What one join cost the first worker."""

    in_flight: float  # its runs in flight when the second worker started
    revokes: float
    finished: float  # runs of the moved partitions committed during the revoke
    released: float  # claims handed back to run again
    held_s: float  # how long the revoke(s) held its consumer
    handover_s: float  # its hand-overs, from the revoke until the moved runs were gone
    waited_s: float  # how long the second worker's takeover waited for them
    calls: float  # model calls made (answered or cut short), both workers
    took_s: float  # from the join to the last run's finish
    moved_record_s: list[float]  # the late users on moved partitions: produce -> ledger


LATE_SOURCE = "rebalance-late"


def _late(count: int) -> list[tuple[bytes, bytes]]:
    """One message from each of ``count`` new users (spread over every partition)."""
    now = datetime.now(UTC)
    out = []
    for index in range(count):
        ev = load.event(index, count, LATE_SOURCE, now)
        ev = replace(ev, user_id=f"late-{index:05d}")
        out.append((ev.user_id.encode(), load.CODEC.encode(ev)))
    return out


def _join(stack: BenchStack, plan: Plan, size: Size, late: bool = False, **settings: str) -> Join:
    """One worker fills its slots, a second joins; what that cost (``settings``: both workers').
    ``late``: once the hand-over has begun, ``size.late`` new users send a message each."""
    # The first wave's answers are held until the join is under way: on a loaded machine the
    # second worker can take longer to start than a run takes, and a join with no run in
    # flight measures nothing (it failed the bench with "no hand-over began" once).
    with claude_stack(stack, plan, size, held=True, **settings) as (servers, dsn, topics, workers):  # type: ignore[arg-type]
        first = workers.procs[0]
        with (
            load.BenchProducer(stack.bootstrap, topics.events) as producer,
            psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn,
        ):
            producer.blast(load.encoded(size.users, size.users, "rb"))
            full = FULL_SHARE * min(size.users, size.concurrency)
            deadline = time.monotonic() + START_TIMEOUT_S
            while first.metric("vigil_runs_in_flight") < full:
                if time.monotonic() > deadline:
                    raise ServiceDied(f"the first worker's slots did not fill within {START_TIMEOUT_S:.0f}s")
                workers.check()
                time.sleep(0.1)
            in_flight = first.metric("vigil_runs_in_flight")
            joined = time.monotonic()
            workers.add()
            extra = 0
            if late:
                deadline = time.monotonic() + START_TIMEOUT_S
                while conn.execute(M.rebalance_handing).fetchone()["n"] == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no hand-over began within {START_TIMEOUT_S:.0f}s of the join")
                    workers.check()
                    time.sleep(0.02)
                servers.release()
                producer.blast(_late(size.late))
                extra = size.late
            else:
                deadline = time.monotonic() + START_TIMEOUT_S
                while first.metric("vigil_worker_revoke_seconds_count") < 1:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no revoke within {START_TIMEOUT_S:.0f}s of the join")
                    workers.check()
                    time.sleep(0.02)
                servers.release()
            wait_finished(conn, size.users + extra, workers, servers)
            took = time.monotonic() - joined
            moved = [r["s"] for r in conn.execute(M.rebalance_moved_record_s, {"source": LATE_SOURCE}).fetchall()]
        revokes = first.metric("vigil_worker_revoke_seconds_count")
        if revokes < 1:
            raise RuntimeError("the first worker saw no revoke: the second worker took no partition")
        return Join(
            in_flight=in_flight,
            revokes=revokes,
            finished=first.metric("vigil_revoke_runs_finished_total"),
            released=first.metric("vigil_claims_released_total"),
            held_s=first.metric("vigil_worker_revoke_seconds_sum"),
            handover_s=first.metric("vigil_worker_handover_seconds_sum"),
            waited_s=workers.procs[1].metric("vigil_worker_handover_wait_seconds_sum"),
            calls=workers.metric("vigil_model_requests_total"),
            took_s=took,
            moved_record_s=moved,
        )


def rebalance(stack: BenchStack, plan: Plan, report: Report) -> None:
    size = SIZES[plan.name]
    answers = f"{size.users} users, answers in {size.delay_s - size.spread_s:g}-{size.delay_s + size.spread_s:g} s"
    grace = _join(stack, plan, size, late=True)
    note = (
        f"a second worker joined with {grace.in_flight:.0f} runs in flight on the first ({answers}, the default"
        f" VIGIL_REVOKE_GRACE_S); {grace.revokes:.0f} revoke(s); {grace.calls:.0f} model calls made for"
        f" {size.users + size.late} runs of 2; all done {grace.took_s:.1f} s after the join"
    )
    report.add(Figure("rebalance_runs_finished_in_grace", [grace.finished], per="rebalance", note=note))
    report.add(Figure("rebalance_runs_released", [grace.released], per="rebalance", note=note))
    report.add(Figure("rebalance_revoke_s", [grace.held_s], per="rebalance", note=note))
    report.add(Figure("rebalance_handover_s", [grace.handover_s], per="rebalance", note=note))
    report.add(Figure("rebalance_takeover_wait_s", [grace.waited_s], per="rebalance", note=note))
    report.add(Figure("rebalance_model_calls_per_run", [grace.calls / (size.users + size.late)], per="run", note=note))
    moved_note = (
        f"{size.late} new users sent a message each once the hand-over had begun; {len(grace.moved_record_s)} of"
        f" them on the moved partitions: produce -> ledger"
    )
    report.add(Figure("rebalance_moved_record_s", grace.moved_record_s, per="event", note=moved_note))
    # The same join with the grace off (a rebalance before VIGIL_REVOKE_GRACE_S): what it buys.
    bare = _join(stack, plan, size, VIGIL_REVOKE_GRACE_S="0")
    note = (
        f"the same join with VIGIL_REVOKE_GRACE_S=0, {bare.in_flight:.0f} runs in flight ({answers});"
        f" {bare.revokes:.0f} revoke(s) holding the first worker {bare.held_s:.1f} s; {bare.calls:.0f} model calls"
        f" made (answered or cut short) for {size.users} runs; all done {bare.took_s:.1f} s after the join"
    )
    report.add(Figure("rebalance_runs_released_without_grace", [bare.released], per="rebalance", note=note))
    report.add(Figure("rebalance_model_calls_per_run_without_grace", [bare.calls / size.users], per="run", note=note))


def summary(report: Report, line) -> None:
    """What the rebalance cost, for the bench's closing summary (no target)."""
    v = report.value
    finished, released, held, handover, waited, calls, moved, released_bare, calls_bare = (v(name) for name in FIGURES)
    if None in (finished, released, held, handover, waited, calls, moved, released_bare, calls_bare):
        line("rebalance", None, "missing input", None)
        return
    line(
        "rebalance",
        released,
        f"{finished:.0f} runs of the moved partitions finished during the revoke, {released:.0f} released to run"
        f" again, {calls:.2f} model calls per run; the hand-over took {handover:.1f} s, the second worker's"
        f" takeover waited {waited:.1f} s, the first worker's recording paused {held:.2f} s, new events on the"
        f" moved partitions reached the ledger in {moved:.2f} s (median)."
        f" Without the grace: {released_bare:.0f} released, {calls_bare:.2f} model calls per run (no target)",
        None,
    )
