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

-- name: replays_record
-- One what-if replay of a kept run, as the command printed it (the console's run page lists them).
INSERT INTO run_replays (run_key, user_id, made_by, ran_with, verdict, messages_changed, report)
VALUES (%(run_key)s, %(user_id)s, %(made_by)s, %(ran_with)s, %(verdict)s, %(messages_changed)s, %(report)s::json)

-- name: replays_of_run
-- The replays of a run, newest first: those of its key and of a later attempt's (<key>~<attempt>).
SELECT r.id, r.run_key, r.made_at, r.made_by, r.ran_with, r.verdict, r.messages_changed
FROM run_replays r
WHERE r.user_id = %(user_id)s AND (r.run_key = %(run_key)s OR starts_with(r.run_key, %(run_key)s || '~'))
ORDER BY r.made_at DESC, r.id DESC
LIMIT %(limit)s
