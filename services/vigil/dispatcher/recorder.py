"""Recording outcomes: what each send's receiver said, written to the ledger.

Outcomes are kept (:meth:`Recorder.keep`) as their sends finish and recorded by
:meth:`Recorder.settle`: the accepted sends that arrived together in one short transaction
(one statement, one commit: one round trip per outcome was most of a pass), a failure on its
own (a retry after a backoff, or dead). Each record is fenced by the attempt number, so an
outcome that arrives after its attempt was taken over changes nothing. A crash loses at most
the outcomes not yet recorded, and those deliveries are sent again under their own ids once
their lease passes. A ledger that goes away after a send loses nothing: the outcome is kept
and recorded as soon as the ledger answers again, so the row does not sit ``sending`` for the
whole lease.

Each delivery that ended (delivered, retried later or dead) is reported to ``on_ended``: the
user's newer messages may be due now.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from datetime import timedelta

import psycopg
from psycopg.rows import DictRow

from vigil import logs
from vigil.clock import Clock, utc
from vigil.dispatcher import metrics
from vigil.dispatcher.channels import Delivery, Outcome, Result
from vigil.dispatcher.claims import Limits, record_dead, record_delivered, record_retry
from vigil.dispatcher.pacing import retry_delay
from vigil.dispatcher.settings import DispatcherSettings

log = logging.getLogger("vigil.dispatcher")


class Recorder:
    """The outcomes not recorded yet, and their recording. ``conn`` returns the loop's ledger
    connection; ``on_ended(user_id)`` hears of every delivery whose attempt ended."""

    def __init__(
        self,
        settings: DispatcherSettings,
        limits: Limits,
        clock: Clock,
        conn: Callable[[], psycopg.Connection[DictRow]],
        on_ended: Callable[[str], None],
    ):
        self.settings = settings
        self.limits = limits
        self.clock = clock
        self._conn = conn
        self._on_ended = on_ended
        # Sends whose outcome is not recorded yet (just finished, or the ledger went away).
        self._unrecorded: list[tuple[Delivery, Outcome]] = []

    @property
    def unrecorded(self) -> int:
        return len(self._unrecorded)

    def keep(self, delivery: Delivery, outcome: Outcome) -> None:
        """A send finished: its outcome waits for :meth:`settle`."""
        self._unrecorded.append((delivery, outcome))

    def settle_left_over(self) -> None:
        """Before a claim: first what earlier sends could not record (the ledger went away)."""
        left_over = len(self._unrecorded)
        self.settle()
        metrics.SETTLED_AFTER_RECONNECT.inc(left_over)

    def settle(self) -> None:
        """Record the outcomes kept so far, in the order their sends finished. After a ledger
        error this is called as soon as the ledger answers again, before the next claim: the
        rows leave ``sending`` now instead of after their lease, and a user's newer messages
        stop waiting behind them. Each record is fenced by the attempt number, so an outcome
        whose lease another dispatcher took over in the meantime is dropped. Accepted sends
        are recorded together, the others one by one."""
        while self._unrecorded:
            batch = self._next_batch()
            try:
                self.record_many(batch)
            except psycopg.OperationalError:
                raise  # the ledger is away: kept for the reconnect
            except psycopg.Error:
                del self._unrecorded[: len(batch)]  # refused, not unreachable: the lease sends them again
                raise
            del self._unrecorded[: len(batch)]

    def _next_batch(self) -> list[tuple[Delivery, Outcome]]:
        """The accepted sends at the head of the unrecorded ones (each delivery once), or the
        first outcome alone."""
        batch: list[tuple[Delivery, Outcome]] = []
        ids: set = set()
        for delivery, outcome in self._unrecorded:
            if outcome.result is not Result.DELIVERED or delivery.delivery_id in ids:
                break
            batch.append((delivery, outcome))
            ids.add(delivery.delivery_id)
        return batch or self._unrecorded[:1]

    def record(self, delivery: Delivery, outcome: Outcome) -> None:
        """Write one attempt's outcome (the send already happened; this is the commit after it)."""
        self.record_many([(delivery, outcome)])

    def record_many(self, batch: list[tuple[Delivery, Outcome]]) -> None:
        """Write attempts' outcomes: accepted ones together (one statement, one commit), any
        other alone."""
        if batch[0][1].result is Result.DELIVERED:
            self._record_delivered([delivery for delivery, _ in batch])
            return
        ((delivery, outcome),) = batch
        with logs.context(user_id=delivery.user_id):  # every line about it names the user
            self._record(delivery, outcome)

    def _record_delivered(self, deliveries: list[Delivery]) -> None:
        if self.settings.dispatcher_crash_after_send:
            log.warning(
                "test hook: SIGKILL after delivery %s was accepted, before the commit", deliveries[0].delivery_id
            )
            os.kill(os.getpid(), signal.SIGKILL)
        now = utc(self.clock.now())
        for delivery, recorded in zip(deliveries, record_delivered(self._conn(), deliveries, now), strict=True):
            self._on_ended(delivery.user_id)
            channel = delivery.channel.type.value
            with logs.context(user_id=delivery.user_id):
                if not recorded.stood:
                    self._superseded(delivery, Result.DELIVERED)
                    continue
                metrics.DELIVERIES.labels(channel, Result.DELIVERED.value).inc()
                for created_at in recorded.created_at:
                    metrics.LATENCY.labels(channel).observe(max(0.0, (now - created_at).total_seconds()))
                log.debug(
                    "delivered %s to %s (%d messages)", delivery.delivery_id, delivery.user_id, len(delivery.rows)
                )

    def _superseded(self, delivery: Delivery, result: Result) -> None:
        metrics.SUPERSEDED.labels(delivery.channel.type.value).inc()
        log.warning(
            "delivery %s attempt %d: outcome %s dropped, the lease was taken over (it went out again)",
            delivery.delivery_id,
            delivery.attempt,
            result,
        )

    def _record(self, delivery: Delivery, outcome: Outcome) -> None:
        """A failed attempt's outcome: a retry after a backoff, or dead."""
        self._on_ended(delivery.user_id)
        channel = delivery.channel.type.value
        now = utc(self.clock.now())
        if outcome.result is Result.RETRY and delivery.attempt < self.limits.max_attempts:
            delay = retry_delay(
                delivery.attempt,
                self.settings.delivery_backoff_base_s,
                self.settings.delivery_backoff_cap_s,
                outcome.retry_after_s,
            )
            recorded = record_retry(self._conn(), delivery, now + timedelta(seconds=delay), outcome.error or "failed")
            if recorded.stood:
                metrics.RETRIES.labels(channel, "failed").inc()
                log.info(
                    "delivery %s to %s: attempt %d failed (%s), next in %.0fs",
                    delivery.delivery_id,
                    delivery.user_id,
                    delivery.attempt,
                    outcome.error,
                    delay,
                )
        else:
            exhausted = outcome.result is Result.RETRY
            reason = "exhausted" if exhausted else "rejected"
            error = (
                f"{outcome.error}; dead after {delivery.attempt} attempts"
                if exhausted
                else (outcome.error or "rejected")
            )
            recorded = record_dead(self._conn(), delivery, now, error)
            if recorded.stood:
                metrics.DEAD.labels(channel, reason).inc()
                metrics.DELIVERIES.labels(channel, Result.DEAD.value).inc()
                log.warning("delivery %s to %s is dead: %s", delivery.delivery_id, delivery.user_id, error)
        if not recorded.stood:
            self._superseded(delivery, outcome.result)
