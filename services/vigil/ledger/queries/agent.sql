-- The Claude agent's reads and writes: what a run starts from (sessions, memory, past
-- messages, the approvals it resumes), the saved sessions, and the demo refund tool's record.
-- services/vigil/agent/run_ledger.py calls the first group; the worker's finish the upsert.

-- name: agent_sessions_load_many
-- The saved sessions named by a claim pass's events, (user, session id) pairs: only each user's own.
SELECT s.user_id, s.id, s.state, s.messages, s.blocks, s.consecutive_blocks, s.pending
FROM unnest(%(user_ids)s::text[], %(ids)s::text[]) AS w(user_id, id)
JOIN sessions s ON s.id = w.id AND s.user_id = w.user_id

-- name: agent_session_of_user
-- Whether this user has a saved session by this id: ingest refuses a chat message naming any other session (another user's, or none).
SELECT EXISTS (SELECT 1 FROM sessions WHERE id = %(session_id)s AND user_id = %(user_id)s) AS found

-- name: agent_memory_load_many
-- The memory files of a claim pass's users, path -> content.
SELECT user_id, path, content FROM memory WHERE user_id = ANY(%(user_ids)s) ORDER BY user_id, path

-- name: agent_recent_messages_many
-- Per user of a claim pass (with its limit): what the user was already told (delivered outbox rows) and what the outbox still holds for them (queued: pending or sending), newest first, lim in all; queued rows are the newest.
SELECT w.user_id, past.body, past.queued
FROM unnest(%(user_ids)s::text[], %(limits)s::int[]) WITH ORDINALITY AS w(user_id, lim, n)
CROSS JOIN LATERAL (
    SELECT body, queued, at FROM (
        (SELECT body, false AS queued, delivered_at AS at FROM outbox
         WHERE user_id = w.user_id AND status = 'delivered' ORDER BY delivered_at DESC LIMIT w.lim)
        UNION ALL
        (SELECT body, true AS queued, created_at AS at FROM outbox
         WHERE user_id = w.user_id AND status IN ('pending', 'sending') ORDER BY id DESC LIMIT w.lim)
    ) both_kinds
    ORDER BY queued DESC, at DESC LIMIT w.lim
) past
ORDER BY w.n, past.queued DESC, past.at DESC

-- name: agent_dead_events_many
-- Per user of a claim pass: their events given up on (dead) since their last run that did not fail started, the oldest %(limit)s: the agent hears of them once, at its next run. Dead events are rare: the events_dead index, the users filter, then each one's last run.
SELECT user_id, id, source, kind, received_at, attempts, error FROM (
    SELECT e.user_id, e.id, e.source, e.kind, e.received_at, e.attempts, e.error, e.finished_at,
           row_number() OVER (PARTITION BY e.user_id ORDER BY e.finished_at) AS n
    FROM events e
    WHERE e.status = 'dead' AND e.user_id = ANY(%(user_ids)s)
      AND e.finished_at > coalesce(
          (SELECT max(r.started_at) FROM runs r WHERE r.user_id = e.user_id AND r.outcome <> 'failed'),
          '-infinity')
) dead
WHERE n <= %(limit)s
ORDER BY user_id, finished_at

-- name: agent_policies_many
-- The overrides of a claim pass's users (a user with none has no row).
SELECT user_id, event_policies FROM agent_policies WHERE user_id = ANY(%(user_ids)s)

-- name: agent_policies_get
-- The user's overrides of deployment-wide agent settings (none: no row).
SELECT user_id, event_policies, updated_at FROM agent_policies WHERE user_id = %(user_id)s

-- name: agent_policies_set
-- Operators (`vigil policies set`): replace the user's overrides ('' clears them).
INSERT INTO agent_policies (user_id, event_policies) VALUES (%(user_id)s, %(event_policies)s)
ON CONFLICT (user_id) DO UPDATE SET event_policies = EXCLUDED.event_policies, updated_at = now()
RETURNING user_id, event_policies, updated_at

-- name: agent_approvals_load_many
-- The approval requests named by a claim pass's approval events, (user, request id) pairs, with the hash of what was approved.
SELECT a.user_id, a.request_id, a.session_id, a.tool, a.tool_use_id, a.args_hash, a.answer
FROM unnest(%(user_ids)s::text[], %(ids)s::text[]) AS w(user_id, request_id)
JOIN approvals a ON a.request_id = w.request_id AND a.user_id = w.user_id

-- name: agent_sessions_save_many
-- The sessions a finish group's runs saved (open, waiting on a deferred call, or closed): one statement for the group, never another user's row.
INSERT INTO sessions (id, user_id, state, messages, size_bytes, blocks, consecutive_blocks, pending)
-- The conversations and pending calls come as two JSON arrays (one document each, in the
-- rows' order): a text[] of large JSON strings cost the worker a quoting pass per string.
SELECT s.id, s.user_id, s.state, m.value, s.size_bytes, s.blocks, s.consecutive, NULLIF(p.value, 'null'::jsonb)
FROM unnest(%(ids)s::text[], %(user_ids)s::text[], %(states)s::text[], %(sizes)s::int[], %(blocks)s::int[],
            %(consecutive)s::int[])
     WITH ORDINALITY AS s(id, user_id, state, size_bytes, blocks, consecutive, n)
JOIN jsonb_array_elements(%(messages)s::jsonb) WITH ORDINALITY AS m(value, n) ON m.n = s.n
JOIN jsonb_array_elements(%(pending)s::jsonb) WITH ORDINALITY AS p(value, n) ON p.n = s.n
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
-- In the finish, after finish_runs: each message's session (a reply to its delivery resumes it), deadline and answer actions (an approval question), by run and position among that run's messages.
UPDATE outbox o
SET session_id = t.session_id, deadline = t.deadline, actions = t.actions
FROM (
    SELECT id, run_id, row_number() OVER (PARTITION BY run_id ORDER BY id) AS n
    FROM outbox WHERE run_id = ANY(%(run_id)s::bigint[])
) m
JOIN unnest(%(run_id)s::bigint[], %(n)s::int[], %(session_id)s::text[], %(deadline)s::timestamptz[], %(actions)s::jsonb[])
     AS t(run_id, n, session_id, deadline, actions) ON t.run_id = m.run_id AND t.n = m.n
WHERE o.id = m.id
