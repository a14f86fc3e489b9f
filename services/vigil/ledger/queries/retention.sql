-- Retention: what the ledger forgets, and when. Read services/vigil/ledger/retention.py.
-- Events go a whole day at a time (a partition dropped); every other statement deletes one
-- batch, oldest first, FOR UPDATE SKIP LOCKED, so any number of scheduler replicas prune at
-- once without waiting on each other or deleting a row twice.

-- name: ensure_partitions
-- The day partitions of events from yesterday to %(ahead)s days ahead (and the days of rows waiting in the default partition), made before anyone needs them.
SELECT ensure_event_partitions(%(ahead)s) AS made

-- name: event_days_past
-- The day partitions of events whose whole day is older than %(before)s, oldest first (events_pYYYYMMDD: the name is the day).
SELECT c.relname AS name, to_date(substr(c.relname, 9), 'YYYYMMDD') AS day
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'events'::regclass AND c.relname ~ '^events_p[0-9]{8}$'
  AND (to_date(substr(c.relname, 9), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC' <= %(before)s
ORDER BY c.relname

-- name: count_event_day
-- Rows in one day partition, counted before the drop (outside its lock: nobody writes a day past retention but the carry below).
SELECT count(*)::bigint AS n FROM {partition}

-- name: lock_events
-- The drop's lock, over the parent and every partition: statements that started before it finish first, later ones wait (a few ms); so no claim or finish holds a row the carry moves.
LOCK TABLE events IN ACCESS EXCLUSIVE MODE

-- name: event_day_exists
-- Whether the day partition is still there once the lock is held (another scheduler may have dropped it).
SELECT to_regclass(%(name)s) IS NOT NULL AS present

-- name: carry_unfinished
-- Pending and running events of a day leaving retention move to the current day (recorded_at set to now: row movement), so dropping the day never loses work.
UPDATE events SET recorded_at = now()
WHERE recorded_at >= %(lo)s AND recorded_at < %(hi)s AND status IN ('pending', 'running')

-- name: drop_event_day
-- Retention of events: the whole day partition goes at once (detached and dropped in one step; its dedup keys stay in event_keys).
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
