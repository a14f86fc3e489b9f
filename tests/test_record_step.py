"""The worker's record step (:func:`vigil.ledger.events.record_batch`): a polled batch and
the consumer positions past it commit together, or neither does and the recorder's
connection goes on."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
import pytest

from support import query, scalar
from vigil.ledger.db import connect
from vigil.ledger.events import prepare_record_connection, record_batch
from vigil.ledger.partitions import PartitionKey

HOME = PartitionKey("events", 0)


def staged(n: int, user_id: str | None, source_id: str, offset: int) -> tuple:
    """A staging row (``STAGING_TYPES`` order)."""
    now = datetime.now(UTC)
    return (n, user_id, "test", source_id, "chat.message", '{"text": "hi"}', None, {}, None, now, "events", 0, offset)


def test_a_failed_record_stores_neither_events_nor_positions_and_the_next_batch_records(ledger):
    with connect(ledger) as conn:
        prepare_record_connection(conn)
        # A row the statement refuses (no user): the whole batch and its positions roll back.
        with pytest.raises(psycopg.IntegrityError):
            record_batch(conn, [staged(0, "ada", "first", 10), staged(1, None, "refused", 11)], [], {HOME: 12})
        assert not conn.broken
        assert scalar(ledger, "SELECT count(*) FROM consumer_positions") == 0
        # The same connection records the next batch, and only that batch: nothing of the
        # failed one was left behind in its staging table.
        assert record_batch(conn, [staged(0, "ada", "second", 12)], ["ada"], {HOME: 13}) == 1
        assert record_batch(conn, [], [], {HOME: 14}) == 0  # undecodable messages only: positions alone
    assert query(ledger, "SELECT source_id FROM events") == [{"source_id": "second"}]
    assert scalar(ledger, "SELECT next_offset FROM consumer_positions WHERE topic = 'events' AND partition = 0") == 14
    assert scalar(ledger, "SELECT home_partition FROM users WHERE user_id = 'ada'") == 0


def test_a_recorded_batch_is_four_round_trips(ledger):
    """BEGIN, the COPY's two, the statement with the COMMIT (counted through the bench's
    relay): with the ledger across a network each one is on every event's way in."""
    from vigil_dev.bench.pgproxy import PgProxy

    with PgProxy(ledger) as proxy, connect(proxy.dsn) as conn:
        prepare_record_connection(conn)
        before = proxy.round_trips()
        assert record_batch(conn, [staged(n, "ada", f"e{n}", n) for n in range(50)], ["ada"], {HOME: 50}) == 50
        assert proxy.round_trips() - before == 4
        before = proxy.round_trips()
        assert record_batch(conn, [], [], {HOME: 51}) == 0  # positions alone: BEGIN, then the rest
        assert proxy.round_trips() - before == 2
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert scalar(ledger, "SELECT count(*) FROM events") == 50
    assert scalar(ledger, "SELECT next_offset FROM consumer_positions WHERE topic = 'events' AND partition = 0") == 51
