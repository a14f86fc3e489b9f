-- Retention: what the ledger forgets, and when. Read services/vigil/ledger/retention.py.
-- Each statement deletes one batch, oldest first; FOR UPDATE SKIP LOCKED lets any number of
-- scheduler replicas prune at once without waiting on each other or deleting a row twice.

-- name: prune_events
-- Finished events (done or dead) past retention. Their dedup keys go with them, which is why retention is never shorter than the dedup window. Walks the primary key: ids follow recording time, so the old rows are at the front.
DELETE FROM events WHERE id IN (
    SELECT id FROM events
    WHERE status IN ('done', 'dead') AND recorded_at < %(before)s AND finished_at < %(before)s
    ORDER BY id
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
