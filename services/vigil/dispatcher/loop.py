"""The dispatcher's loop: claim, send in parallel, record the outcomes.

:class:`Dispatcher` wires the parts (docs/dispatcher.md, "The loop's parts") and runs them:

- choosing what to send: :mod:`vigil.dispatcher.chooser` (which users the next claim looks
  at; :func:`vigil.dispatcher.claims.claim` fixes and commits what is due among them);
- sending: :mod:`vigil.dispatcher.sender` (the send pool, the passes still out);
- recording outcomes: :mod:`vigil.dispatcher.recorder` (fenced, the accepted ones together).

They talk through two callbacks: a finished send's outcome goes to the recorder
(``on_outcome``), and a delivery that ended brings its user back to the chooser's attention
(``on_ended``). The loop owns the ledger connection the chooser and the recorder use. Nothing
is sent that the ledger has not fixed first.

The claims overlap the sends (:meth:`Dispatcher.run`): the next claim does not wait for the
previous one's sends, only for room, so a receiver that takes its whole timeout holds one send
thread and nobody else's delivery. Claimed deliveries not yet sent never number more than
``VIGIL_DISPATCHER_BATCH_USERS``, the bound the settings check the lease against.

Several ledger shards (``VIGIL_LEDGER_SHARDS``): a :class:`Dispatcher` per shard, each this
loop on a thread of its own (:func:`run_shards`), with its own connection, cursor, send pool
and recorder. A user's outbox and pacing state are all on the user's shard, so every claim
and record is one shard's transaction; the channels are the catalog's (shard 0), read by the
claims of the other shards. A shard that does not answer stops only its own thread's claims.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime

import psycopg
from psycopg.rows import DictRow

from vigil import retry
from vigil.clock import Clock
from vigil.dispatcher import metrics
from vigil.dispatcher.channels import Channels
from vigil.dispatcher.chooser import Chooser
from vigil.dispatcher.claims import Limits
from vigil.dispatcher.recorder import Recorder
from vigil.dispatcher.sender import Sender
from vigil.dispatcher.settings import DispatcherSettings
from vigil.ledger import channels as ledger_channels
from vigil.ledger import db, outbox
from vigil.ledger.channels import ChannelRow
from vigil.ledger.states import OutboxStatus

log = logging.getLogger("vigil.dispatcher")

# The backlog gauges cost a scan of the undelivered rows: every few seconds is plenty for a
# dashboard and nothing for the database.
BACKLOG_REFRESH_S = 10.0
# With several shards, a connect to a shard (or the catalog) that does not answer gives up
# after this long and is retried after the reconnect pause.
SHARD_CONNECT_TIMEOUT_S = 5


def limits_of(settings: DispatcherSettings) -> Limits:
    return Limits(
        default_gap_s=settings.outbox_gap,
        default_urgent_cap=settings.urgent_daily_cap,
        max_attempts=settings.delivery_max_attempts,
        lease_s=settings.delivery_lease_s,
        batch_users=settings.dispatcher_batch_users,
        attention=outbox.Attention(
            settings.attention_adapt,
            settings.attention_min_gap_s,
            settings.attention_max_gap_s,
            settings.attention_reply_window_s,
        ),
    )


class Dispatcher:
    """Relays one ledger shard's outbox (``shard``: its index in ``VIGIL_LEDGER_SHARDS``, 0
    with one shard): a chooser, a sender and a recorder on one ledger connection."""

    def __init__(
        self,
        settings: DispatcherSettings,
        clock: Clock,
        channels: Channels,
        connect: Callable[[], psycopg.Connection[DictRow]] | None = None,
        *,
        shard: int = 0,
    ):
        self.settings = settings
        self.clock = clock
        self.shard = shard
        self.retry_policy = retry.dispatcher_pass()
        self.limits = limits_of(settings)
        self._timeout = SHARD_CONNECT_TIMEOUT_S if len(settings.shard_dsns) > 1 else None
        dsn = settings.shard_dsns[shard]
        self._connect = connect or (lambda: db.connect(dsn, autocommit=True, connect_timeout=self._timeout))
        self._conn: psycopg.Connection[DictRow] | None = None
        self._catalog_conn: psycopg.Connection[DictRow] | None = None
        self._backlog_at = 0.0
        self.chooser = Chooser(
            self.limits,
            clock,
            settings.dispatcher_poll_interval_s,
            lambda: self.conn,
            catalog=self._catalog_channels if shard != 0 else None,
        )
        self.recorder = Recorder(settings, self.limits, clock, lambda: self.conn, on_ended=self.chooser.ended)
        self.sender = Sender(
            settings.dispatcher_concurrency, clock, channels, on_outcome=self.recorder.keep, shard=str(shard)
        )

    @property
    def conn(self) -> psycopg.Connection[DictRow]:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        return self._conn

    def _catalog_channels(self, user_ids: list[str]) -> Mapping[str, ChannelRow]:
        """The channels of locked users, from the catalog (shard 0), on its own connection."""
        if self._catalog_conn is None or self._catalog_conn.closed:
            self._catalog_conn = db.connect(self.settings.dsn, autocommit=True, connect_timeout=self._timeout)
        return ledger_channels.of_users(self._catalog_conn, user_ids)

    def _collect(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for sends to finish (none: until one does), then record every
        outcome that has arrived."""
        self.sender.collect(timeout)
        self.recorder.settle()
        self.sender.finish_passes()

    def refresh_backlog(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._backlog_at < BACKLOG_REFRESH_S:
            return
        self._backlog_at = time.monotonic()
        counts = {OutboxStatus.PENDING.value: 0, OutboxStatus.SENDING.value: 0}
        oldest: datetime | None = None
        for row in outbox.backlog(self.conn):
            counts[row.status] = row.messages
            oldest = row.oldest if oldest is None else min(oldest, row.oldest)
        shard = str(self.shard)
        for status, count in counts.items():
            metrics.BACKLOG.labels(status, shard).set(count)
        age = 0.0 if oldest is None else max(0.0, self.clock.now() - oldest.timestamp())
        metrics.OLDEST_AGE.labels(shard).set(age)

    def run(self, stopping: threading.Event, on_health: Callable[[bool], None] = lambda ok: None) -> None:
        """Claims, sends and records until ``stopping`` is set; the sends in flight then finish
        and are recorded.

        Order for each delivery: the claim commits its id (and the user's pacing), then the
        send runs, then the outcome commits. A crash after the claim or after a send leaves
        rows ``sending`` under their lease: once it passes they go out again with the same
        ids. A crash after an outcome's commit leaves nothing to redo.

        The next claim does not wait for the previous one's sends: whenever at least half of
        ``VIGIL_DISPATCHER_BATCH_USERS`` is free (claimed deliveries whose send has not
        finished count against it) the loop claims that many more users, so a receiver that
        takes its whole timeout holds one send thread, not the deliveries behind it. At most
        ``VIGIL_DISPATCHER_BATCH_USERS`` deliveries are ever waiting or being sent, the bound
        the settings check the lease against. It claims again at once when the last claim was
        full (more may be due) or everything it sent is recorded, otherwise after the poll
        interval.
        """
        poll = self.settings.dispatcher_poll_interval_s
        batch = self.limits.batch_users
        threshold = max(1, batch // 2)
        full = False  # the last claim took as many users as it asked for: more may be due now
        sent = False  # the last claim sent something: claim again once it is all recorded
        claim_at = 0.0  # otherwise claim again at this monotonic time
        while not stopping.is_set() or self.sender.in_flight:
            try:
                room = batch - self.sender.in_flight
                if (
                    not stopping.is_set()
                    and room >= threshold
                    and (full or (sent and not self.sender.in_flight) or time.monotonic() >= claim_at)
                ):
                    self.recorder.settle_left_over()
                    claimed, closed_sweep = self.chooser.claim_due(room)
                    self.sender.start(claimed.deliveries, closed_sweep)
                    full = claimed.users_locked >= room
                    sent = bool(claimed.deliveries)
                    claim_at = time.monotonic() + poll
                if stopping.is_set() or batch - self.sender.in_flight < threshold:
                    wait_s = poll  # no claim now: until a send finishes (a poll's time at most)
                elif full:
                    wait_s = 0.0  # claim again at once
                else:  # until a send finishes or the next claim is due
                    wait_s = max(0.0, claim_at - time.monotonic())
                self._collect(wait_s)
                self.refresh_backlog()
                metrics.SHARD_UP.labels(str(self.shard)).set(1)
                on_health(True)
            except self.retry_policy.retried as exc:
                # The ledger went away (restart, failover) or refused a statement: nothing was
                # sent that it had not fixed, and what was sent but not recorded is recorded
                # after the reconnect or goes out again after its lease. Reconnect and carry
                # on; a bug elsewhere still crashes.
                where = f" (shard {self.shard})" if self._timeout is not None else ""
                log.error(
                    "ledger error%s, reconnecting: %s: %s",
                    where,
                    type(exc).__name__,
                    exc,
                    extra={"event": "pass_failed"},
                )
                metrics.SHARD_UP.labels(str(self.shard)).set(0)
                on_health(False)
                self.close_connection()
                stopping.wait(self.retry_policy(exc)[1])
                continue
            self.retry_policy.succeeded()
            if not self.sender.in_flight and not full and not sent:
                stopping.wait(max(0.0, claim_at - time.monotonic()))

    def close_connection(self) -> None:
        try:
            if self._conn is not None:
                self._conn.close()
            if self._catalog_conn is not None:
                self._catalog_conn.close()
        finally:
            self._conn = self._catalog_conn = None

    def close(self) -> None:
        self.sender.close()
        self.close_connection()


def run_shards(
    dispatchers: list[Dispatcher], stopping: threading.Event, on_health: Callable[[bool], None] = lambda ok: None
) -> None:
    """Each shard's :meth:`Dispatcher.run` on a thread of its own until ``stopping`` (one shard:
    on this thread, as ever). A shard that does not answer holds only its own thread, however
    long its connects or statements take. ``on_health`` hears whether every shard's last pass
    went through. A loop that dies sets ``stopping`` (the others finish their sends) and its
    exception is raised here once they have."""
    if len(dispatchers) == 1:
        dispatchers[0].run(stopping, on_health)
        return
    healthy = [True] * len(dispatchers)
    died: list[BaseException] = []
    lock = threading.Lock()

    def serve(index: int, dispatcher: Dispatcher) -> None:
        def report(ok: bool) -> None:
            with lock:
                healthy[index] = ok
                on_health(all(healthy))

        try:
            dispatcher.run(stopping, report)
        except BaseException as exc:
            log.exception("shard %d's delivery loop died", dispatcher.shard, extra={"event": "loop_died"})
            died.append(exc)
            stopping.set()

    threads = [
        threading.Thread(target=serve, args=(index, d), name=f"dispatch-{d.shard}", daemon=True)
        for index, d in enumerate(dispatchers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if died:
        raise died[0]
