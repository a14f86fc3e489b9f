"""When to claim: the claim loop and its pass (docs/worker.md, "Claiming"; the rules in
docs/architecture.md, "Claim rules").

:class:`Claimer` owns the partitions this worker holds (``owned``: their epochs, set on
assignment, dropped on revoke) and runs a claim pass whenever :class:`Wakeups` says one is
due. A pass, under the claim lock: once per scan interval rule 2 (exhausted events become
``dead``) and the look for a lone last attempt (:mod:`vigil.worker.lone`); once per heal
interval the heal of orphaned claims; then claims up to ``VIGIL_RUN_CONCURRENCY`` minus the
runs in flight (at most ``VIGIL_CLAIM_PASS_MAX``, then another pass at once), round-robin
from a cursor (:func:`vigil.ledger.claims.claim`), and starts them
(:class:`vigil.worker.runs.Runs`). The claim lock keeps a pass and a rebalance apart:
a revoked partition's claims are never started after its runs were cancelled. What a revoke
then does with the partition's runs is :mod:`vigil.worker.handover`'s.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import psycopg
from psycopg.rows import DictRow

from vigil import retry
from vigil.clock import Clock, utc
from vigil.ledger import claims as ledger_claims
from vigil.ledger import recovery as ledger_recovery
from vigil.ledger.claims import Claim, DeadEvent, alone_due, claim, claim_alone, mark_dead
from vigil.ledger.db import AsyncPool
from vigil.ledger.partitions import PartitionKey
from vigil.worker import metrics
from vigil.worker.deadletters import DeadLetters
from vigil.worker.handover import HandOvers
from vigil.worker.lone import Gate, LoneAttempt
from vigil.worker.runs import Active, Runs
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import Shards
from vigil.worker.wakeups import BACKOFF_SLACK_S, Wakeups

log = logging.getLogger(__name__)

# Several shards: a claim pass waits this long for a connection to one shard, and skips a
# shard that failed for this long, so a shard that does not answer delays the others' claims
# by at most SHARD_CONNECT_S now and then, never a pool timeout every pass.
SHARD_CONNECT_S = 2.0
SHARD_PAUSE_S = 5.0


class Claimer:
    """The partitions held, the claim loop, the claim pass; the consumer calls ``assign`` and ``revoke``."""

    def __init__(
        self,
        settings: WorkerSettings,
        pool: AsyncPool | Shards,
        dead_letters: DeadLetters,
        runs: Runs,
        wakeups: Wakeups,
        clock: Clock,
        lone: LoneAttempt | None = None,
    ) -> None:
        self.settings = settings
        self.shards = Shards.of(pool)  # each partition's claims on its shard
        self.dead_letters = dead_letters
        self.runs = runs
        self.wakeups = wakeups
        self.clock = clock
        self.lone = lone or LoneAttempt(settings, runs, wakeups, clock)  # claim rule 3: its due time, its drain
        self.retry_policy = retry.worker_claim_pass()
        self.owned: dict[PartitionKey, int] = {}
        self.stopping = False
        self._claim_lock = asyncio.Lock()
        self._cursor: dict[int, str] = {}  # per shard, the round robin's position among waiting users (claims.claim)
        self._first = 0  # the shard a pass starts with, turning: no shard's claims always come last
        self._shard_down_until: dict[int, float] = {}  # monotonic: a shard whose claims failed is skipped until then
        self._next_dead_check = 0.0
        self._next_heal = 0.0  # orphaned claims at our epochs: on assignment, then periodically
        self.handovers = HandOvers(self.shards, runs, clock, self._drop)  # revoked partitions' runs wound down

    @property
    def active(self) -> dict[str, Active]:
        """The runs in flight (held by :class:`Runs`), one per user."""
        return self.runs.active

    def wake(self, delay: float = 0.0) -> None:
        self.wakeups.wake(delay)

    def heal_soon(self) -> None:
        """Look for orphaned claims at the next pass (a finish commit whose outcome is unknown)."""
        self._next_heal = 0.0

    async def assign(self, epochs: dict[PartitionKey, int]) -> None:
        """Claim for these partitions (their epochs are the takeover's): a pass now, rule 2 and
        the heal at it, and a pass at the end of each claim the takeover handed back."""
        await self.shards.open(k.partition for k in epochs)
        async with self._claim_lock:
            self.owned.update(epochs)
            self._next_dead_check = 0.0  # the takeover may have handed back exhausted claims
            self._next_heal = 0.0
        self._count_held()
        self.wake()
        # The takeover handed the previous owner's claims back with jittered backoffs: wake
        # when each ends, so they come back one by one as they did before this process
        # (a poison event among them then tends to run, and crash us, alone).
        ends = []
        now = utc(self.clock.now())
        try:
            for shard, keys in self.shards.split(sorted(epochs), _partition).items():
                async with self.shards.pool(shard).connection() as conn:
                    ends += await ledger_claims.backoff_ends(conn, keys, now=now)
        except psycopg.Error as exc:
            log.warning("could not read backoffs after a takeover (the periodic pass finds them): %s", exc)
            return
        for at in ends:
            self.wake((at - now).total_seconds() + BACKOFF_SLACK_S)

    async def revoke(self, keys: list[PartitionKey], release: bool = True, grace_s: float = 0.0) -> None:
        """Stop claiming for ``keys``, give their runs ``grace_s``, then cancel and release the
        rest; return when that is done (:meth:`HandOvers.revoke`)."""
        await self.handovers.revoke(keys, release, grace_s)

    async def hand_over(self, keys: list[PartitionKey], grace_s: float) -> None:
        """The consumer's revoke: stop claiming for ``keys`` and return at once; their runs get
        ``grace_s`` in the background (:meth:`HandOvers.hand_over`)."""
        await self.handovers.hand_over(keys, grace_s)

    async def handovers_done(self, within_s: float) -> None:
        """Shutdown: wait, at most ``within_s``, for hand-overs in progress to end."""
        await self.handovers.done(within_s)

    def _count_held(self) -> None:
        """The partitions held, in all and per shard (on a rebalance only)."""
        metrics.EPOCHS_HELD.set(len(self.owned))
        per_shard = Counter(self.shards.shard_of(key.partition) for key in self.owned)
        for shard in range(self.shards.count):
            metrics.SHARD_PARTITIONS.labels(str(shard)).set(per_shard[shard])

    async def _drop(self, keys: list[PartitionKey]) -> dict[PartitionKey, int]:
        """No more claims for ``keys`` (under the claim lock: a pass in progress ends first);
        the epochs they were held at."""
        async with self._claim_lock:
            gone = {key: self.owned.pop(key) for key in keys if key in self.owned}
        self._count_held()
        return gone

    async def claim_loop(self) -> None:
        """A pass whenever one is due (:class:`Wakeups`), until shutdown; a ledger error
        retries the pass after its pause (``retry.worker_claim_pass``)."""
        while not self.stopping:
            wait_s = self.wakeups.due_in()
            if wait_s > 0:
                await self.wakeups.wait(wait_s)
                continue
            self.wakeups.begin_pass()
            try:
                with metrics.LEDGER_SECONDS.labels("claim").time():
                    await self._claim_pass()
            except self.retry_policy.retried as exc:
                _, pause = self.retry_policy(exc)
                log.warning("claim pass failed, retrying: %s", exc, extra={"event": "pass_failed"})
                self.wakeups.retry_in(pause)
            else:
                self.retry_policy.succeeded()

    async def _claim_pass(self) -> None:
        """Under the claim lock, on one connection: rule 2 and the lone-attempt look (per scan
        interval), the heal (per heal interval), the claim, the runs' contexts; then, outside
        the lock, publish the dead and start the runs. Claims commit as they are made: a crash
        after one leaves it for the heal or the next owner."""
        free = self.settings.run_concurrency - len(self.active)
        if not self.owned or (free <= 0 and self.clock.monotonic() < self._next_heal):
            return
        take = min(free, self.settings.claim_pass_max)  # the trade-off: settings.DEFAULT_CLAIM_PASS_MAX
        left = take
        dead: list[DeadEvent] = []
        started: list[Active] = []
        async with self._claim_lock:
            # Rule 2 and the look for lone last attempts once per scan interval, not on
            # every pass; the claim never takes an exhausted or lone row in between.
            check = self.clock.monotonic() >= self._next_dead_check
            if check:
                self._next_dead_check = self.clock.monotonic() + self.settings.scan_interval_s
            heal = self.clock.monotonic() >= self._next_heal
            if heal:
                self._next_heal = self.clock.monotonic() + self.settings.heal_interval_s
            # Each shard on its own connection, its partitions only: no statement spans two.
            by_shard = self.shards.split(self.owned.items(), _owned_partition)
            order = sorted(by_shard)
            if len(order) > 1:
                self._first = (self._first + 1) % len(order)
                order = order[self._first :] + order[: self._first]
            failed: list[BaseException] = []
            for shard in order:
                if self.clock.monotonic() < self._shard_down_until.get(shard, 0.0):
                    continue
                owned = dict(by_shard[shard])
                try:
                    timeout = None if self.shards.single else SHARD_CONNECT_S
                    async with self.shards.pool(shard).connection(timeout=timeout) as conn:
                        if check:
                            now = utc(self.clock.now())
                            dead += await mark_dead(conn, owned, self.settings.max_attempts, now=now)
                            self.lone.found(shard, await alone_due(conn, owned, self.settings.max_attempts, now=now))
                        if heal:
                            await self._heal(conn, owned)
                        claims, alone = await self._claim(conn, shard, owned, left) if left > 0 else ([], False)
                        more = [Active(c, alone=alone) for c in claims]
                        if more and self.runs.needs_context:
                            await self.runs.preload(conn, more)
                except self.retry_policy.retried as exc:
                    if self.shards.single:
                        raise
                    # Several shards: one that does not answer waits out its pause; the
                    # others' claims go on (a pass fails only when every shard did).
                    failed.append(exc)
                    self._shard_down_until[shard] = self.clock.monotonic() + SHARD_PAUSE_S
                    log.warning("claims on ledger shard %d failed, skipped for %g s: %s", shard, SHARD_PAUSE_S, exc)
                    continue
                left -= len(claims)
                started += more
            if failed and len(failed) == len(order):
                raise failed[-1]
        if dead:
            metrics.EVENTS_DEAD.inc(len(dead))
            await asyncio.to_thread(self.dead_letters.publish_dead, dead)
        attempts: Counter[str] = Counter()  # one labels() and inc() per label and pass, not per event
        for active in started:
            c = active.claim
            metrics.CLAIM_BATCH.observe(len(c.events))
            attempts.update(str(event.attempts) if event.attempts < 3 else "3+" for event in c.events)
            self.runs.start(active)
            if active.alone:
                self.lone.started(active)
        for label, n in attempts.items():
            metrics.CLAIM_ATTEMPTS.labels(label).inc(n)
        metrics.RUNS_IN_FLIGHT.set(len(self.active))
        if started and left == 0:
            self.wake()  # there may be more; a finishing run frees a slot and wakes us

    async def _heal(self, conn: psycopg.AsyncConnection[DictRow], owned: dict[PartitionKey, int]) -> None:
        """Release the claims at our epochs that no run of ours holds.

        Such a row is a finish the ledger lost (its commit vanished with a crashed server or a
        failover) or a run this process forgot: left alone it would mute its user (claim rule
        4) until the next rebalance. It runs inside the claim pass, under the claim lock, so
        every claim this process made is already in ``self.active`` and the only rows it can
        match are orphans. Counted as lost with their worker, as a takeover counts them.
        """
        healed = await ledger_recovery.release_orphaned_claims(
            conn,
            owned=owned,
            busy=list(self.active),
            max_attempts=self.settings.max_attempts,
            backoff_base_s=self.settings.backoff_base_s,
            backoff_cap_s=self.settings.backoff_cap_s,
            now=utc(self.clock.now()),
        )
        if healed:
            metrics.HEALED.inc(len(healed))
            log.warning(
                "released %d claim(s) at our epoch that no run held (a lost finish?): %d user(s)",
                len(healed),
                len({row.user_id for row in healed}),
            )
            self.wake(self.settings.backoff_base_s + BACKOFF_SLACK_S)

    async def _claim(
        self, conn: psycopg.AsyncConnection[DictRow], shard: int, owned: dict[PartitionKey, int], take: int
    ) -> tuple[list[Claim], bool]:
        """Claim rule 3's lone last attempts before anything else, then the round robin for up
        to ``take`` users, on ``shard`` (``conn``) for its partitions ``owned``. Returns the
        claims and whether they are a lone attempt."""
        gate = await self.lone.gate(shard)
        if gate is Gate.HOLD:
            return [], False  # in flight, or the drain before it, or another shard's
        if gate is Gate.ALONE:
            lone = await claim_alone(conn, owned, self.settings.max_attempts, now=utc(self.clock.now()))
            self._next_dead_check = 0.0  # after it: dead? another one waiting?
            self.lone.end_drain()
            if lone is not None:
                metrics.LONE_RUNS.inc()
                log.warning(
                    "event %d runs alone: its last attempt, and a worker was lost with it before", lone.events[0].id
                )
                return [lone], True
            self.lone.found(shard, None)
        claims, self._cursor[shard] = await claim(
            conn,
            owned=owned,
            busy=list(self.active),
            max_users=take,
            batch_max=self.settings.batch_max,
            window_s=self.settings.batch_window_s,
            max_attempts=self.settings.max_attempts,
            cursor=self._cursor.get(shard, ""),
            now=utc(self.clock.now()),
        )
        return claims, False


def _partition(key: PartitionKey) -> int:
    return key.partition


def _owned_partition(item: tuple[PartitionKey, int]) -> int:
    return item[0].partition
