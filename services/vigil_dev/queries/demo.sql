-- Read-only look-ups for `vigil-dev demo`.

-- name: demo_event_by_key
-- An event by its dedup key (the live queue by its partial indexes, the finished days by user).
SELECT id, status, run_id FROM events
WHERE user_id = %(user_id)s AND source = %(source)s AND source_id = %(source_id)s AND status = 'pending'
UNION ALL
SELECT id, status, run_id FROM events
WHERE user_id = %(user_id)s AND source = %(source)s AND source_id = %(source_id)s AND status = 'running'
UNION ALL
SELECT id, status, run_id FROM events
WHERE user_id = %(user_id)s AND source = %(source)s AND source_id = %(source_id)s AND status IN ('done', 'dead')

-- name: demo_event_done
-- The event once its run finished.
SELECT status, run_id FROM events WHERE id = %(id)s AND status = 'done'

-- name: demo_run_reply
-- The outbox row a run wrote, if any.
SELECT id, body, status FROM outbox WHERE run_id = %(run_id)s ORDER BY id LIMIT 1

-- name: demo_outbox_delivered
-- An outbox row once delivered.
SELECT status, delivery_id FROM outbox WHERE id = %(id)s AND status = 'delivered'

-- name: demo_delivered_after
-- A user's delivered messages after a given outbox id, oldest first.
SELECT id, body, delivery_id, session_id FROM outbox
WHERE user_id = %(user_id)s AND status = 'delivered' AND id > %(after)s ORDER BY id

-- name: demo_session_messages
-- A conversation as the ledger keeps it (the Messages API turns, tool calls and results included).
SELECT messages FROM sessions WHERE id = %(id)s
