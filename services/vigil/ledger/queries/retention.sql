-- Retention: what the ledger forgets, and when. Read services/vigil/ledger/retention.py.
-- Events go a whole day at a time (a partition dropped); every other statement deletes one
-- batch, oldest first, FOR UPDATE SKIP LOCKED, so any number of scheduler replicas prune at
-- once without waiting on each other or deleting a row twice.

-- name: ensure_partitions
-- The day partitions of finished events from yesterday to %(ahead)s days ahead (and the days of rows waiting in the default partition), made before anyone needs them.
SELECT ensure_event_partitions(%(ahead)s) AS made

-- name: event_days_past
-- The day partitions of finished events whose whole day is older than %(before)s, oldest first (events_finished_pYYYYMMDD: the name is the day).
SELECT c.relname AS name
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'events_finished'::regclass AND c.relname ~ '^events_finished_p[0-9]{8}$'
  AND (to_date(substr(c.relname, 18), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC' <= %(before)s
ORDER BY c.relname

-- name: count_event_day
-- Rows in one day of finished events, counted before the drop (only an operator's `vigil dead retry` takes rows out of a day).
SELECT count(*)::bigint AS n FROM {partition}

-- name: drop_event_day
-- Retention of events: a whole day of finished events goes at once (detached and dropped in one step; the live queue and the dedup keys are other tables, untouched).
DROP TABLE {partition}

-- name: prune_event_keys
-- Dedup keys older than the dedup window: a copy of such an event arriving now is new again. Through the BRIN index on recorded_at.
DELETE FROM event_keys WHERE (user_id, source, source_id) IN (
    SELECT user_id, source, source_id FROM event_keys
    WHERE recorded_at < %(before)s
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)

-- name: prune_outbox
-- Messages delivered or given up on past retention (pacing and the urgent cap look back a day at most).
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox
    WHERE (status = 'delivered' AND delivered_at < %(before)s) OR (status = 'dead' AND dead_at < %(before)s)
    ORDER BY id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)

-- name: prune_runs
-- Runs past retention that no outbox row points at any more (the outbox is pruned first).
DELETE FROM runs WHERE id IN (
    SELECT r.id FROM runs r
    WHERE r.finished_at < %(before)s
      AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.run_id = r.id)
    ORDER BY r.id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)

-- name: prune_timers
-- Timers that are done (fired one-offs, cancelled or deleted schedules) and untouched past retention.
DELETE FROM timers WHERE (user_id, id) IN (
    SELECT user_id, id FROM timers
    WHERE done AND updated_at < %(before)s
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
