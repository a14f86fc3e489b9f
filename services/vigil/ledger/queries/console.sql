-- The operator console's reads (services/vigil/ledger/console.py is their only caller).
--
-- Every query is bounded: it returns at most %(limit)s rows, pages by keyset (never OFFSET),
-- and the counts an overview shows stop at %(cap)s rows so that a huge backlog costs the
-- page a bounded scan, not a count of millions. Events are read by their documented columns
-- only (docs/ledger.md), so the storage underneath may change.
--
-- A run's writes (outbox rows, approvals, timers, memory files, tasks) carry its run id,
-- written by its finish: a timeline links them by that id, never by time.

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
-- Undelivered outbox rows (up to %(cap)s, from the outbox_undelivered index) and the oldest one: its creation time, user and run (the overview's links).
WITH o AS MATERIALIZED (SELECT id, user_id, run_id, created_at FROM outbox WHERE status IN ('pending', 'sending') LIMIT %(cap)s),
oldest AS (SELECT user_id, run_id, created_at FROM o ORDER BY created_at, id LIMIT 1)
SELECT (SELECT count(*) FROM o)::int AS undelivered, oldest.created_at AS oldest, oldest.user_id AS oldest_user,
       oldest.run_id AS oldest_run
FROM (SELECT 1) one LEFT JOIN oldest ON true

-- name: console_waiting_on_time
-- Approvals still open and those past their deadline (approvals_open_by_due), live timers past due (timers_due); each count stops at %(cap)s.
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM approvals WHERE answer IS NULL LIMIT %(cap)s) a)::int AS approvals_open,
    (SELECT count(*) FROM (SELECT 1 FROM approvals WHERE answer IS NULL AND due < %(now)s LIMIT %(cap)s) a)::int
        AS approvals_late,
    (SELECT count(*) FROM (SELECT 1 FROM timers WHERE NOT done AND due < %(now)s LIMIT %(cap)s) t)::int AS timers_late

-- name: console_recent_runs
-- The newest runs, newest first.
SELECT id, user_id, epoch, worker, event_ids, started_at, finished_at, outcome, error, turns,
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, tool_calls
FROM runs ORDER BY id DESC LIMIT %(limit)s

-- name: console_user_seen
-- Whether the ledger knows a user, and its home partition.
SELECT user_id, home_topic, home_partition, first_seen_at, last_delivery_at, attention_gap_s, attention_reason
FROM users WHERE user_id = %(user_id)s

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
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, tool_calls
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

-- name: console_timers_of_runs
-- A user's timers last set by one of the given runs (the user's timers through the primary key, then by run id).
SELECT id, user_id, kind, due, every_seconds, cron, tz, catch_up, done, fired_count, last_fired_at, created_at,
       updated_at, run_id
FROM timers
WHERE user_id = %(user_id)s AND run_id = ANY(%(run_ids)s::bigint[])
ORDER BY created_at
LIMIT %(limit)s

-- name: console_memory_of_runs
-- A user's memory files last written by one of the given runs.
SELECT path, length(content)::int AS bytes, updated_at, run_id
FROM memory
WHERE user_id = %(user_id)s AND run_id = ANY(%(run_ids)s::bigint[])
ORDER BY path
LIMIT %(limit)s

-- name: console_tasks_of_runs
-- Background tasks the given runs delegated (tasks_by_user, then by run id), with their state.
SELECT id, status, attempts, max_attempts, depth, lease_holder, lease_epoch, heartbeat_at, deadline, created_at,
       finished_at, cancel_requested_by, left(instructions, 300) AS instructions, left(result, 300) AS result,
       left(error, 300) AS error, input_tokens + output_tokens AS tokens, parent_run_key, reported_at, mode,
       parent_task_id, run_id
FROM tasks
WHERE user_id = %(user_id)s AND run_id = ANY(%(run_ids)s::bigint[])
ORDER BY created_at, id
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
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, tool_calls
FROM runs
WHERE user_id = %(user_id)s AND started_at >= %(since)s AND event_ids @> ARRAY[%(event_id)s::bigint]
ORDER BY started_at, id
LIMIT %(limit)s

-- name: console_run
-- One run.
SELECT id, user_id, epoch, worker, event_ids, started_at, finished_at, outcome, error, turns,
       input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, tool_calls, topic, partition, session_id,
       profile, profile_version
FROM runs WHERE id = %(id)s

-- name: console_run_by_key
-- One run by its key (user:first event id): the run its first event records.
SELECT r.id, r.user_id, r.epoch, r.worker, r.event_ids, r.started_at, r.finished_at, r.outcome, r.error, r.turns,
       r.input_tokens, r.output_tokens, r.cache_read_tokens, r.cache_write_tokens, r.tool_calls, r.topic,
       r.partition, r.session_id, r.profile, r.profile_version
FROM events e JOIN runs r ON r.id = e.run_id
WHERE e.id = %(first)s AND e.user_id = %(user_id)s AND r.user_id = %(user_id)s
  AND (SELECT min(x) FROM unnest(r.event_ids) x) = %(first)s

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
-- Events with a source id, of any user, recorded within the dedup window: the keys by event_keys_by_source_id, then each key's event through its user's indexes (pending, running, or finished since the key was recorded: run-time pruning skips older day partitions). Newest first.
WITH k AS (
    SELECT user_id, source, recorded_at FROM event_keys
    WHERE source_id = %(source_id)s
    ORDER BY recorded_at DESC
    LIMIT %(limit)s
)
SELECT e.*
FROM k CROSS JOIN LATERAL (
    SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
           finished_at, run_id
    FROM events WHERE user_id = k.user_id AND source = k.source AND source_id = %(source_id)s AND status = 'pending'
    UNION ALL
    SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
           finished_at, run_id
    FROM events WHERE user_id = k.user_id AND source = k.source AND source_id = %(source_id)s AND status = 'running'
    UNION ALL
    -- A finish comes after the record (whose now() is the key's recorded_at); the minute
    -- covers a database clock stepped back in between.
    SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
           finished_at, run_id
    FROM events WHERE user_id = k.user_id AND source = k.source AND source_id = %(source_id)s
                  AND status IN ('done', 'dead') AND finished_at >= k.recorded_at - interval '1 minute'
) e
ORDER BY e.id DESC
LIMIT %(limit)s

-- name: console_user_events_by_source_id
-- One user's events with a source id, whatever their age (the user's events through its indexes), newest first.
SELECT id, user_id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at,
       finished_at, run_id
FROM events
WHERE user_id = %(user_id)s AND source_id = %(source_id)s
ORDER BY id DESC
LIMIT %(limit)s

-- name: console_operator_actions
-- The latest retries and revivals operators made (audit rows, newest first): who did what to which ids.
SELECT id, at, actor, action, detail::text AS detail
FROM audit
WHERE action IN ('dead.retry', 'delivery.revive')
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
-- Every partition the ledger knows (assigned, recorded from, or home to a pending event): its fencing epoch and holder (and the holder's hand-over deadline while it lasts), the ledger's consumer position (the next offset it will record) and its pending events, counted by their users' home partition (whose holder runs them; counting stops at %(cap)s pending events, read from the pending index).
WITH p AS MATERIALIZED (SELECT user_id FROM events WHERE status = 'pending' LIMIT %(cap)s),
pending AS (
    SELECT u.home_topic AS topic, u.home_partition AS partition, sum(pu.n)::int AS pending
    FROM (SELECT user_id, count(*) AS n FROM p GROUP BY user_id) pu JOIN users u ON u.user_id = pu.user_id
    GROUP BY 1, 2
),
known AS (
    SELECT topic, partition FROM partitions
    UNION SELECT topic, partition FROM consumer_positions
    UNION SELECT topic, partition FROM pending
)
SELECT k.topic, k.partition, pt.epoch, pt.holder, pt.acquired_at,
       CASE WHEN pt.handover_until > now() THEN pt.handover_until END AS handover_until,
       c.next_offset, c.updated_at AS recorded_at,
       coalesce(pe.pending, 0) AS pending, (SELECT count(*) FROM p) >= %(cap)s AS pending_capped
FROM known k
LEFT JOIN partitions pt ON pt.topic = k.topic AND pt.partition = k.partition
LEFT JOIN consumer_positions c ON c.topic = k.topic AND c.partition = k.partition
LEFT JOIN pending pe ON pe.topic = k.topic AND pe.partition = k.partition
ORDER BY k.topic, k.partition
LIMIT %(limit)s

-- name: console_tasks_of_user
-- A user's tasks (background and sync children), newest first (tasks_by_user index), bounded.
SELECT id, status, attempts, max_attempts, depth, lease_holder, lease_epoch, heartbeat_at, deadline, created_at,
       finished_at, cancel_requested_by, left(instructions, 300) AS instructions, left(result, 300) AS result,
       left(error, 300) AS error, input_tokens + output_tokens AS tokens, parent_run_key, reported_at, mode,
       parent_task_id, turns, last_tool, note, progress_at
FROM tasks
WHERE user_id = %(user_id)s
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
