-- The finish: everything a run decided, written in one fenced transaction with its events'
-- new state (see services/vigil/worker/finish.py for the order and what a crash leaves).

-- name: insert_run
-- The run's audit row; its id ties the outbox rows and events to it.
INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, session_id, started_at, finished_at,
                  outcome, error, turns, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens)
VALUES (%(user_id)s, %(topic)s, %(partition)s, %(epoch)s, %(worker)s, %(event_ids)s, %(session_id)s, %(started_at)s, now(),
        %(outcome)s, %(error)s, %(turns)s, %(input_tokens)s, %(output_tokens)s, %(cache_read_tokens)s, %(cache_write_tokens)s)
RETURNING id

-- name: insert_outbox
-- A message the run decided to send, under the epoch it was written with.
INSERT INTO outbox (user_id, run_id, epoch, body, urgent)
VALUES (%(user_id)s, %(run_id)s, %(epoch)s, %(body)s, %(urgent)s)

-- name: insert_timer
-- A follow-up or approval expiry set by the run. Re-setting the same id replaces a timer that has not fired yet.
INSERT INTO timers AS t (id, user_id, kind, due, catch_up, payload, fixed_key)
-- Due times are whole seconds: round up, so a follow-up never fires before the time asked for.
VALUES (%(id)s, %(user_id)s, %(kind)s, date_trunc('second', %(due)s::timestamptz + interval '999999 microseconds'),
        %(catch_up)s, %(payload)s, %(fixed_key)s)
ON CONFLICT (user_id, id) DO UPDATE
SET due = EXCLUDED.due, payload = EXCLUDED.payload, fixed_key = EXCLUDED.fixed_key, kind = EXCLUDED.kind,
    catch_up = EXCLUDED.catch_up, updated_at = now()
WHERE NOT t.done

-- name: upsert_memory
-- The memory tool's create/str_replace/insert/rename target.
INSERT INTO memory (user_id, path, content) VALUES (%(user_id)s, %(path)s, %(content)s)
ON CONFLICT (user_id, path) DO UPDATE SET content = EXCLUDED.content, updated_at = now()

-- name: delete_memory
-- The memory tool's delete (and rename's source).
DELETE FROM memory WHERE user_id = %(user_id)s AND path = %(path)s
