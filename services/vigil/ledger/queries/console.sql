-- The operator console's reads (services/vigil/ledger/console.py is their only caller).
--
-- Every query is bounded: it returns at most %(limit)s rows, pages by keyset (never OFFSET),
-- and the counts an overview shows stop at %(cap)s rows so that a huge backlog costs the
-- page a bounded scan, not a count of millions. Events are read by their documented columns
-- only (README "The ledger"), so the storage underneath may change.
--
-- A run's writes other than its outbox rows and approvals carry no run id: they are found by
-- the run's finish time. The finish is one transaction, and now() is that transaction's
-- start, so runs.finished_at, timers.created_at/updated_at and memory.updated_at of the
-- same finish are equal to the microsecond (one run per user per finish group).

-- name: console_pending_backlog
-- Pending events (up to %(cap)s of them) and the earliest recorded one (lowest id), read from the pending index alone.
WITH p AS MATERIALIZED (SELECT id FROM events WHERE status = 'pending' LIMIT %(cap)s)
SELECT (SELECT count(*) FROM p)::int AS pending,
       (SELECT received_at FROM events WHERE id = (SELECT min(id) FROM p) AND status = 'pending') AS oldest

-- name: console_oldest_pending
-- The earliest recorded pending events (lowest ids) among the first %(cap)s found, with their users (links into timelines).
WITH p AS MATERIALIZED (SELECT id FROM events WHERE status = 'pending' LIMIT %(cap)s)
SELECT id, user_id, source, kind, attempts, received_at
FROM events
WHERE id IN (SELECT id FROM p ORDER BY id LIMIT %(limit)s) AND status = 'pending'
ORDER BY id

-- name: console_runs_per_minute
-- Runs finished per minute over the last %(minutes)s minutes (counting stops at %(cap)s runs).
SELECT date_trunc('minute', finished_at) AS minute, count(*)::int AS runs
FROM (SELECT finished_at FROM runs WHERE finished_at > now() - make_interval(mins => %(minutes)s) LIMIT %(cap)s) r
GROUP BY 1
ORDER BY 1

-- name: console_dead_since
-- Events and deliveries that died since %(since)s (each count stops at %(cap)s).
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM events WHERE status = 'dead' AND finished_at >= %(since)s LIMIT %(cap)s) e)::int
        AS dead_events,
    (SELECT count(*) FROM (SELECT 1 FROM outbox WHERE status = 'dead' AND dead_at >= %(since)s LIMIT %(cap)s) o)::int
        AS dead_outbox_rows

-- name: console_outbox_backlog
-- Undelivered outbox rows (up to %(cap)s) and the oldest one's creation time.
SELECT count(*)::int AS undelivered, min(created_at) AS oldest
FROM (SELECT created_at FROM outbox WHERE status IN ('pending', 'sending') LIMIT %(cap)s) o

-- name: console_recent_runs
-- The newest runs, newest first.
SELECT id, user_id, epoch, worker, event_ids, started_at, finished_at, outcome, error, turns,
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens
FROM runs ORDER BY id DESC LIMIT %(limit)s

-- name: console_user_seen
-- Whether the ledger knows a user, and its home partition.
SELECT user_id, home_topic, home_partition, first_seen_at, last_delivery_at FROM users WHERE user_id = %(user_id)s

-- name: console_user_events_page
-- A user's events before the keyset (received_at, 0, id) < (%(t)s, %(k)s, %(i)s), newest first.
SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
       finished_at, run_id
FROM events
WHERE user_id = %(user_id)s AND (received_at, 0, id) < (%(t)s::timestamptz, %(k)s::int, %(i)s::bigint)
ORDER BY received_at DESC, id DESC
LIMIT %(limit)s

-- name: console_user_runs_page
-- A user's runs before the keyset (started_at, 1, id) < (%(t)s, %(k)s, %(i)s), newest first.
SELECT id, user_id, epoch, worker, event_ids, started_at, finished_at, outcome, error, turns,
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens
FROM runs
WHERE user_id = %(user_id)s AND (started_at, 1, id) < (%(t)s::timestamptz, %(k)s::int, %(i)s::bigint)
ORDER BY started_at DESC, id DESC
LIMIT %(limit)s

-- name: console_outbox_of_runs
-- Outbox rows written by the given runs, with their delivery state.
SELECT id, user_id, run_id, epoch, body, urgent, created_at, status, delivery_id, attempts, next_attempt_at,
       delivered_at, dead_at, channel, error
FROM outbox WHERE run_id = ANY(%(run_ids)s::bigint[])
ORDER BY id
LIMIT %(limit)s

-- name: console_approvals_of_runs
-- Approval requests the given runs wrote, with their answers.
SELECT request_id, user_id, run_id, tool, due, on_expiry, escalations, answer, answered_at, received_at, created_at
FROM approvals WHERE user_id = %(user_id)s AND run_id = ANY(%(run_ids)s::bigint[])
ORDER BY created_at
LIMIT %(limit)s

-- name: console_timers_set_at
-- A user's timers created or last set at one of the given finish instants (see the header).
SELECT id, user_id, kind, due, every_seconds, cron, tz, catch_up, done, fired_count, last_fired_at, created_at,
       updated_at
FROM timers
WHERE user_id = %(user_id)s
  AND (created_at = ANY(%(instants)s::timestamptz[]) OR updated_at = ANY(%(instants)s::timestamptz[]))
ORDER BY created_at
LIMIT %(limit)s

-- name: console_memory_written_at
-- A user's memory files last written at one of the given finish instants (see the header).
SELECT path, length(content)::int AS bytes, updated_at
FROM memory
WHERE user_id = %(user_id)s AND updated_at = ANY(%(instants)s::timestamptz[])
ORDER BY path
LIMIT %(limit)s

-- name: console_event
-- One event with its payload and headers.
SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
       finished_at, run_id, payload, headers::text AS headers, session_id, next_attempt_at, retried_by, retried_at,
       kafka_topic, kafka_partition, kafka_offset
FROM events WHERE id = %(id)s

-- name: console_runs_of_event
-- The runs that took an event (a failed attempt, then the one that finished it), oldest first.
SELECT id, user_id, epoch, worker, event_ids, started_at, finished_at, outcome, error, turns,
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens
FROM runs
WHERE user_id = %(user_id)s AND started_at >= %(since)s AND event_ids @> ARRAY[%(event_id)s::bigint]
ORDER BY started_at, id
LIMIT %(limit)s

-- name: console_run
-- One run.
SELECT id, user_id, epoch, worker, event_ids, started_at, finished_at, outcome, error, turns,
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, topic, partition, session_id
FROM runs WHERE id = %(id)s

-- name: console_events_by_id
-- Events by id (a run's events), in id order.
SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
       finished_at, run_id
FROM events WHERE id = ANY(%(ids)s::bigint[])
ORDER BY id
LIMIT %(limit)s

-- name: console_delivery
-- The outbox rows of one delivery id.
SELECT id, user_id, run_id, epoch, body, urgent, created_at, status, delivery_id, attempts, next_attempt_at,
       delivered_at, dead_at, channel, error, fixed_at
FROM outbox WHERE delivery_id = %(delivery_id)s
ORDER BY id
LIMIT %(limit)s

-- name: console_events_by_source_id
-- Events with a source id: one user's (the dedup key's index), or any user's among the newest %(window)s events (a bounded scan).
SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
       finished_at, run_id
FROM events
WHERE source_id = %(source_id)s
  AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s)
  AND (%(user_id)s::text IS NOT NULL OR id > (SELECT coalesce(max(id), 0) FROM events) - %(window)s)
ORDER BY id DESC
LIMIT %(limit)s

-- name: console_dead_events_page
-- Dead events before the keyset (finished_at, id) < (%(t)s, %(i)s), newest first.
SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
       finished_at, run_id
FROM events
WHERE status = 'dead' AND (finished_at, id) < (%(t)s::timestamptz, %(i)s::bigint)
ORDER BY finished_at DESC, id DESC
LIMIT %(limit)s

-- name: console_dead_outbox_page
-- Dead outbox rows before the keyset (dead_at, id) < (%(t)s, %(i)s), newest first (grouped by delivery in Python).
SELECT id, user_id, run_id, epoch, body, urgent, created_at, status, delivery_id, attempts, next_attempt_at,
       delivered_at, dead_at, channel, error
FROM outbox
WHERE status = 'dead' AND (dead_at, id) < (%(t)s::timestamptz, %(i)s::bigint)
ORDER BY dead_at DESC, id DESC
LIMIT %(limit)s

-- name: console_open_approvals
-- Approval requests still waiting for an answer, nearest deadline first, after the keyset (due, request_id).
SELECT request_id, user_id, run_id, tool, due, on_expiry, escalations, answer, answered_at, received_at, created_at
FROM approvals
WHERE answer IS NULL AND (due, request_id) > (%(t)s::timestamptz, %(i)s::text)
ORDER BY due, request_id
LIMIT %(limit)s

-- name: console_timers_due_before
-- Live timers due before %(until)s (late ones first), after the keyset (due, user_id, id).
SELECT id, user_id, kind, due, every_seconds, cron, tz, catch_up, done, fired_count, last_fired_at, created_at,
       updated_at
FROM timers
WHERE NOT done AND due < %(until)s AND (due, user_id, id) > (%(t)s::timestamptz, %(u)s::text, %(i)s::text)
ORDER BY due, user_id, id
LIMIT %(limit)s

-- name: console_partitions
-- Every partition's fencing epoch and holder.
SELECT topic, partition, epoch, holder, acquired_at
FROM partitions
ORDER BY topic, partition
LIMIT %(limit)s

-- name: console_tasks_of_user
-- A user's background tasks, newest first (tasks_by_user index), bounded.
SELECT id, status, attempts, max_attempts, depth, lease_holder, lease_epoch, heartbeat_at, deadline, created_at,
       finished_at, cancel_requested_by, left(instructions, 300) AS instructions, left(result, 300) AS result,
       left(error, 300) AS error, input_tokens + output_tokens AS tokens, parent_run_key, reported_at
FROM tasks
WHERE user_id = %(user_id)s
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
