-- The Claude agent's reads and writes: what a run starts from (sessions, memory, past
-- messages, the approvals it resumes), the saved sessions, and the demo refund tool's record.
-- services/vigil/agent/context.py calls the first group; the worker's finish the upsert.

-- name: agent_sessions_load
-- The saved sessions named by a claim's events (only the user's own).
SELECT id, state, messages, blocks, consecutive_blocks, pending
FROM sessions WHERE user_id = %(user_id)s AND id = ANY(%(ids)s)

-- name: agent_memory_load
-- The user's memory files, path -> content.
SELECT path, content FROM memory WHERE user_id = %(user_id)s ORDER BY path

-- name: agent_recent_messages
-- What the user was already told (delivered outbox rows), newest first.
SELECT body FROM outbox WHERE user_id = %(user_id)s AND status = 'delivered'
ORDER BY delivered_at DESC LIMIT %(limit)s

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
