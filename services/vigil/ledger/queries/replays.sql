-- What-if replays (`vigil runs replay`): the kept runs they read. Read services/vigil/ledger/replays.py.

-- name: replays_events
-- A kept run's events by id, as the agent saw them (its journal's start names them; their payloads are kept with the events).
SELECT e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.received_at, e.attempts
FROM events e
WHERE e.user_id = %(user_id)s AND e.id = ANY(%(ids)s)
ORDER BY e.id

-- name: replays_sample
-- Up to `limit` kept run journals finished since `since` (of one profile, when given), a stable spread over their keys (md5: the same sample for the same runs, not only the latest ones).
SELECT j.user_id, j.run_key
FROM run_journal j
WHERE j.step = 1 AND j.kind = 'model' AND j.finished_at IS NOT NULL AND j.finished_at >= %(since)s
  AND NOT starts_with(j.run_key, 'task:')
  AND (%(profile)s::text IS NULL OR j.body -> 'start' -> 'profile' ->> 0 = %(profile)s)
ORDER BY md5(j.run_key)
LIMIT %(limit)s

-- name: replays_memory
-- The user's memory files as they are now, path -> content (a replay reads them; it writes none).
SELECT path, content FROM memory WHERE user_id = %(user_id)s ORDER BY path
