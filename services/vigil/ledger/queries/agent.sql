-- The Claude agent's reads and writes: what a run starts from (sessions, memory, past
-- messages, the approvals it resumes), the saved sessions, and the demo refund tool's record.
-- services/vigil/agent/run_ledger.py calls the first group; the worker's finish the upsert.

-- name: agent_sessions_load
-- The saved sessions named by a claim's events (only the user's own).
SELECT id, state, messages, blocks, consecutive_blocks, pending
FROM sessions WHERE user_id = %(user_id)s AND id = ANY(%(ids)s)

-- name: agent_memory_load
-- The user's memory files, path -> content.
SELECT path, content FROM memory WHERE user_id = %(user_id)s ORDER BY path

-- name: agent_recent_messages
-- What the user was already told (delivered outbox rows) and what the outbox still holds for them (queued: pending or sending), newest first, %(limit)s in all; queued rows are the newest.
SELECT body, queued FROM (
    (SELECT body, false AS queued, delivered_at AS at FROM outbox
     WHERE user_id = %(user_id)s AND status = 'delivered' ORDER BY delivered_at DESC LIMIT %(limit)s)
    UNION ALL
    (SELECT body, true AS queued, created_at AS at FROM outbox
     WHERE user_id = %(user_id)s AND status IN ('pending', 'sending') ORDER BY id DESC LIMIT %(limit)s)
) past
ORDER BY queued DESC, at DESC LIMIT %(limit)s

-- name: agent_dead_events
-- The user's events given up on (dead) since their last run that did not fail started: the agent hears of them once, at its next run. Dead events are rare: the events_dead index, then the user filter.
WITH told AS (
    SELECT max(started_at) AS at FROM runs WHERE user_id = %(user_id)s AND outcome <> 'failed'
)
SELECT e.id, e.source, e.kind, e.received_at, e.attempts, e.error
FROM events e, told
WHERE e.status = 'dead' AND e.user_id = %(user_id)s AND e.finished_at > coalesce(told.at, '-infinity')
ORDER BY e.finished_at
LIMIT %(limit)s

-- name: agent_policies_get
-- The user's overrides of deployment-wide agent settings (none: no row).
SELECT user_id, event_policies, updated_at FROM agent_policies WHERE user_id = %(user_id)s

-- name: agent_policies_set
-- Operators (`vigil policies set`): replace the user's overrides ('' clears them).
INSERT INTO agent_policies (user_id, event_policies) VALUES (%(user_id)s, %(event_policies)s)
ON CONFLICT (user_id) DO UPDATE SET event_policies = EXCLUDED.event_policies, updated_at = now()
RETURNING user_id, event_policies, updated_at

-- name: agent_approvals_load
-- The approval requests named by a claim's approval events, with the hash of what was approved.
SELECT request_id, session_id, tool, tool_use_id, args_hash, answer
FROM approvals WHERE user_id = %(user_id)s AND request_id = ANY(%(ids)s)

-- name: agent_session_upsert
-- The saved conversation after the run (open, waiting on a deferred call, or closed); never another user's row.
INSERT INTO sessions (id, user_id, state, messages, size_bytes, blocks, consecutive_blocks, pending)
VALUES (%(id)s, %(user_id)s, %(state)s, %(messages)s, %(size_bytes)s, %(blocks)s, %(consecutive_blocks)s, %(pending)s)
ON CONFLICT (id) DO UPDATE
SET state = EXCLUDED.state, messages = EXCLUDED.messages, size_bytes = EXCLUDED.size_bytes,
    blocks = EXCLUDED.blocks, consecutive_blocks = EXCLUDED.consecutive_blocks, pending = EXCLUDED.pending,
    updated_at = now()
WHERE sessions.user_id = EXCLUDED.user_id

-- name: refund_record
-- The demo refund tool's "payment provider": one refund per idempotency key; zero rows when the key was used before.
INSERT INTO refunds (idempotency_key, user_id, order_id, amount, reason)
VALUES (%(idempotency_key)s, %(user_id)s, %(order_id)s, %(amount)s, %(reason)s)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, user_id, order_id, amount

-- name: refund_get
-- The refund an idempotency key already made.
SELECT id, user_id, order_id, amount FROM refunds WHERE idempotency_key = %(idempotency_key)s

-- name: outbox_tag_messages
-- In the finish, after finish_runs: each message's session (a reply to its delivery resumes it) and deadline (an approval question), by run and position among that run's messages.
UPDATE outbox o
SET session_id = t.session_id, deadline = t.deadline
FROM (
    SELECT id, run_id, row_number() OVER (PARTITION BY run_id ORDER BY id) AS n
    FROM outbox WHERE run_id = ANY(%(run_id)s::bigint[])
) m
JOIN unnest(%(run_id)s::bigint[], %(n)s::int[], %(session_id)s::text[], %(deadline)s::timestamptz[])
     AS t(run_id, n, session_id, deadline) ON t.run_id = m.run_id AND t.n = m.n
WHERE o.id = m.id
