"""A revoke's wind-down and a hand-over's lease (docs/worker.md, "Rebalances"; the rule:
:mod:`vigil.ledger.partitions`, rule 4).

:class:`HandOvers` takes the partitions the consumer revokes from the claim loop
(``drop``: no more claims for them, under the claim lock; their epochs back) and winds
their runs down: a grace to finish and commit under the epoch that is still ours, a little
more for those that have returned, then cancel and release the rest
(:class:`vigil.worker.runs.Runs`). A hand-over returns at once and does this in the
background, with a deadline in the partitions' rows, renewed while the runs last, that the
next owner's takeover waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import psycopg

from vigil.clock import Clock, utc
from vigil.ledger import partitions as ledger_partitions
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics
from vigil.worker.runs import Runs
from vigil.worker.shards import Shards

log = logging.getLogger(__name__)

# How long a revoke waits, after its grace, for runs that have returned to commit
# (Runs.wait_gone) before it releases them too: a finish takes milliseconds; this bounds a
# ledger outage.
REVOKE_COMMIT_WAIT_S = 5.0
# A hand-over's deadline is this far ahead, renewed every HANDOVER_RENEW_S while its runs
# last (the grace, their commits, the releases): a revoking worker that dies holds its
# partitions' next owner back by this much at most, not by the whole grace. A stall longer
# than the lease (a frozen process) lets the next owner take over: the stalled runs' finishes
# are then fenced out, as for a lost partition.
HANDOVER_LEASE_S = 5.0
HANDOVER_RENEW_S = 1.0


class HandOvers:
    """The revoked partitions' runs wound down, and the hand-overs in progress."""

    def __init__(
        self,
        shards: Shards,
        runs: Runs,
        clock: Clock,
        drop: Callable[[list[PartitionKey]], Awaitable[dict[PartitionKey, int]]],
    ) -> None:
        self.shards = shards
        self.runs = runs
        self.clock = clock
        self._drop = drop  # the claim loop's: no more claims for these partitions; the epochs they were held at
        self._handovers: set[asyncio.Task[None]] = set()  # revoked partitions' runs finishing (hand_over)

    async def revoke(self, keys: list[PartitionKey], release: bool = True, grace_s: float = 0.0) -> None:
        """Stop claiming for ``keys``; give their runs ``grace_s`` to finish, then cancel the
        rest and hand their claims back; return when that is done. A shutdown's drain (no
        grace: it had its own), a lost partition, and a hand-over the ledger refused.

        Runs that finish within the grace, and those whose agent has returned by its end,
        commit (:meth:`Runs.wait_gone`), so a rebalance does not run finished work again.
        A release is fenced like a finish: if the new owner already took over, it matches
        nothing and the takeover's hand-back has done the job. A *lost* partition
        (``release=False``) waits for nothing: its new owner may hold it already; its runs'
        claims are given back in the background (:meth:`Runs.cancel`), so that a takeover that
        came first does not make a lone last attempt of this live worker its event's death.
        """
        began = time.monotonic()  # a measurement, not a decision: the host's clock
        await self._wind_down(await self._drop(keys), release, grace_s)
        metrics.REVOKE_SECONDS.observe(time.monotonic() - began)

    async def hand_over(self, keys: list[PartitionKey], grace_s: float) -> None:
        """The consumer's revoke (rule 4 of :mod:`vigil.ledger.partitions`): stop claiming for
        ``keys`` and return at once, so the consumer goes on recording; the runs of ``keys``
        in flight get ``grace_s`` to finish in the background, as :meth:`revoke` gives them.

        Their epochs stay ours meanwhile: the partitions' rows carry a hand-over deadline that
        the next owner's takeover waits for (until it passes or we clear it, once those runs
        are gone). Without runs in flight, or without a grace, they are released at once; if
        the ledger cannot take the deadline, the grace is waited here instead, as before
        hand-overs (the group gives the partitions to nobody until this returns)."""
        began = time.monotonic()
        gone = await self._drop(keys)
        moving = [a for a in self.runs.active.values() if a.claim.home in gone]
        handing = {a.claim.home: gone[a.claim.home] for a in moving}
        log.info(
            "partitions revoked: %s; %d run(s) of theirs in flight%s",
            ", ".join(str(k.partition) for k in sorted(gone)) or "none held",
            len(moving),
            f", handed over for up to {grace_s:g}s" if handing and grace_s > 0 else "",
        )
        if not handing or grace_s <= 0:
            await self._wind_down(gone, True, 0.0)
        else:
            try:
                await self._begin_handover(handing)
            except psycopg.Error as exc:
                log.warning("could not leave a hand-over in the ledger (the revoke waits for its runs): %s", exc)
                await self._wind_down(gone, True, grace_s)
            else:
                task = asyncio.create_task(self._hand_over(gone, handing, grace_s), name="hand-over")
                self._handovers.add(task)
                task.add_done_callback(self._handovers.discard)
        metrics.REVOKE_SECONDS.observe(time.monotonic() - began)

    async def done(self, within_s: float) -> None:
        """Shutdown: wait, at most ``within_s``, for hand-overs in progress to end."""
        if self._handovers:
            await asyncio.wait(set(self._handovers), timeout=max(within_s, 0.0))

    async def _hand_over(self, gone: dict[PartitionKey, int], handing: dict[PartitionKey, int], grace_s: float) -> None:
        """In the background: the runs' grace, the deadline renewed meanwhile, then cleared
        (the next owner's takeover goes ahead at once). Not cleared, the deadline still ends
        the wait."""
        began = time.monotonic()
        renewing = asyncio.create_task(self._renew_handover(handing), name="hand-over-lease")
        try:
            await self._wind_down(gone, True, grace_s)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            try:
                for shard, keys in self.shards.split(handing, _partition).items():
                    async with self.shards.pool(shard).connection() as conn:
                        await ledger_partitions.end_handover(conn, {k: handing[k] for k in keys})
            except psycopg.Error as exc:
                log.warning("could not end the hand-over (the next owner waits for its deadline): %s", exc)
            took = time.monotonic() - began
            metrics.HANDOVER_SECONDS.observe(took)
            log.info(
                "hand-over of partitions %s ended after %.1fs",
                ", ".join(str(k.partition) for k in sorted(handing)),
                took,
            )

    async def _renew_handover(self, handing: dict[PartitionKey, int]) -> None:
        """Keep the hand-over's deadline HANDOVER_LEASE_S ahead while its runs last."""
        while True:
            await asyncio.sleep(HANDOVER_RENEW_S)
            try:
                await self._begin_handover(handing)
            except psycopg.Error as exc:
                log.warning("could not renew the hand-over (the next owner may take over first): %s", exc)

    async def _begin_handover(self, handing: dict[PartitionKey, int]) -> None:
        """The hand-over's deadline, HANDOVER_LEASE_S ahead, on each partition's shard."""
        now = utc(self.clock.now())
        for shard, keys in self.shards.split(handing, _partition).items():
            async with self.shards.pool(shard).connection() as conn:
                await ledger_partitions.begin_handover(conn, {k: handing[k] for k in keys}, HANDOVER_LEASE_S, now=now)

    async def _wind_down(self, gone: dict[PartitionKey, int], release: bool, grace_s: float) -> None:
        """The runs of ``gone`` in flight: ``grace_s`` to finish and commit, then cancelled
        (``release``: their claims handed back)."""
        victims = [a for a in self.runs.active.values() if a.claim.home in gone]
        held = victims
        if release:
            self.runs.stop_at_boundary(victims)
            victims = await self.runs.wait_gone(victims, grace_s)
            # Runs that have returned by then commit too, rather than run again on the next owner.
            returned = [a for a in victims if a.task is not None and a.task.done()]
            if returned:
                await self.runs.wait_gone(returned, REVOKE_COMMIT_WAIT_S)
                victims = [a for a in victims if self.runs.active.get(a.claim.user_id) is a]
        # Gone and not cancelled (a shutdown's drain may cancel some meanwhile): committed.
        left = {id(a) for a in victims}  # identity: runs are not values to compare
        gone_runs = [a for a in held if id(a) not in left and a.task is not None and not a.task.cancelled()]
        handed = sum(1 for a in gone_runs if a.handed_over)
        finished = len(gone_runs) - handed
        metrics.REVOKE_FINISHED.inc(finished)
        await self.runs.cancel(victims, release)
        if held:
            log.info(
                "revoked %d partition(s): %d run(s) finished and committed first, %d handed over at a step"
                " boundary, %d cancelled%s",
                len(gone),
                finished,
                handed,
                len(victims),
                " and released" if release else " (partitions lost: given back unless taken over)",
            )


def _partition(key: PartitionKey) -> int:
    return key.partition
