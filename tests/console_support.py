"""Test helpers for the operator console: ledger rows as the services write them, and a
logged-in HTTP client of the console application."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

XSS = "<script>alert(1)</script>"


@dataclass
class Seeded:
    user: str
    events: list[int]
    run_id: int
    outbox_id: int
    delivery_id: str
    dead_event: int


def seed_user(dsn: str, user: str = "alice", dead_delivery: bool = True) -> Seeded:
    """A user's history as the services write it: two events (one with a hostile payload), a
    run (three tool calls) that finished them and wrote a message, a timer, an approval request
    and a memory file in its finish transaction (each with its run id), a delivery, and a dead
    event."""
    with psycopg.connect(dsn) as conn:
        conn.execute("INSERT INTO users (user_id, home_topic, home_partition) VALUES (%s, 'test.events', 3)", (user,))
        events = [
            r[0]
            for r in conn.execute(
                "INSERT INTO events (user_id, source, source_id, kind, payload, received_at, status, attempts,"
                " claim_epoch, finished_at)"
                " VALUES (%s, 'chat', 'msg-1', 'chat.message', %s, now() - interval '2 min', 'done', 1, 7, now()),"
                "        (%s, 'github', %s, 'github.push', %s, now() - interval '2 min', 'done', 1, 7, now())"
                " RETURNING id",
                (user, '{"text": "hello"}', user, "gh-" + XSS, '{"ref": "' + XSS + '"}'),
            ).fetchall()
        ]
        dead = conn.execute(
            "INSERT INTO events (user_id, source, source_id, kind, received_at, status, attempts, finished_at, error)"
            " VALUES (%s, 'billing', 'inv-9', 'billing.invoice_paid', now() - interval '1 min', 'dead', 5, now(),"
            " %s) RETURNING id",
            (user, "poison: " + XSS),
        ).fetchone()[0]
        # Their dedup keys, as the worker's record writes them with each event.
        conn.execute(
            "INSERT INTO event_keys (user_id, source, source_id, recorded_at)"
            " SELECT user_id, source, source_id, recorded_at FROM events WHERE user_id = %s",
            (user,),
        )
    with psycopg.connect(dsn) as conn:  # one transaction: the run's finish
        run_id = conn.execute(
            "INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, started_at, finished_at, outcome,"
            " turns, input_tokens, output_tokens, tool_calls) VALUES (%s, 'test.events', 3, 7, 'worker-a', %s,"
            " now() - interval '1 second', now(), 'message', 2, 1200, 80, 3) RETURNING id",
            (user, events),
        ).fetchone()[0]
        conn.execute("UPDATE events SET run_id = %s WHERE id = ANY(%s)", (run_id, events))
        outbox_id = conn.execute(
            "INSERT INTO outbox (user_id, run_id, epoch, body) VALUES (%s, %s, 7, %s) RETURNING id",
            (user, run_id, "reply " + XSS),
        ).fetchone()[0]
        conn.execute(
            "INSERT INTO timers (id, user_id, kind, due, run_id) VALUES ('followup-1', %s, 'followup',"
            " date_trunc('second', now()) + interval '1 hour', %s)",
            (user, run_id),
        )
        conn.execute(
            "INSERT INTO approvals (request_id, user_id, session_id, run_id, tool, args_hash, due)"
            " VALUES ('apr-1', %s, 'ses-1', %s, 'refund', 'h', now() + interval '10 min')",
            (user, run_id),
        )
        conn.execute(
            "INSERT INTO memory (user_id, path, content, run_id) VALUES (%s, '/memories/notes.md', 'x', %s)",
            (user, run_id),
        )
    with psycopg.connect(dsn) as conn:  # the dispatcher's attempts, then its verdict
        delivery_id = conn.execute(
            "UPDATE outbox SET status = %s, delivery_id = gen_random_uuid(), fixed_at = now(), attempts = 12,"
            " channel = 'webhook', dead_at = CASE WHEN %s THEN now() END, error = CASE WHEN %s THEN 'HTTP 500' END,"
            " delivered_at = CASE WHEN %s THEN NULL ELSE now() END"
            " WHERE id = %s RETURNING delivery_id::text",
            (
                "dead" if dead_delivery else "delivered",
                dead_delivery,
                dead_delivery,
                dead_delivery,
                outbox_id,
            ),
        ).fetchone()[0]
    return Seeded(user, events, run_id, outbox_id, delivery_id, dead)
