-- Timers: follow-ups, schedules and approval expiries, and the scheduler's passes over them.
-- Writers: the API and `vigil timers` (timer_upsert, timer_cancel), the worker's fenced finish
-- (timer_upsert for follow-ups and approval expiries), the scheduler (timers_claim_due,
-- timers_apply, timer_set_aside). Every state change checks the state it expects.

-- name: timer_upsert
-- Create or re-register a timer. A live timer keeps its stored due when that is later (it is already past every occurrence fired); a fired one-off is not revived at or before its handled occurrence; approval expiries belong to their approval and are never overwritten.
INSERT INTO timers AS t (id, user_id, kind, due, every_seconds, cron, tz, catch_up, max_lateness, payload, fixed_key,
                        token_id)
VALUES (%(id)s, %(user_id)s, %(kind)s, %(due)s, %(every_seconds)s, %(cron)s, %(tz)s, %(catch_up)s,
        %(max_lateness)s, %(payload)s, %(fixed_key)s, %(token_id)s)
ON CONFLICT (user_id, id) DO UPDATE
SET kind = EXCLUDED.kind,
    due = CASE WHEN t.done THEN EXCLUDED.due ELSE GREATEST(t.due, EXCLUDED.due) END,
    every_seconds = EXCLUDED.every_seconds,
    cron = EXCLUDED.cron,
    tz = EXCLUDED.tz,
    catch_up = EXCLUDED.catch_up,
    max_lateness = EXCLUDED.max_lateness,
    payload = EXCLUDED.payload,
    fixed_key = EXCLUDED.fixed_key,
    done = false,
    skipped = false,
    cancelled_at = NULL,
    error = NULL,
    token_id = EXCLUDED.token_id,  -- counts against the token that registered it last
    run_id = NULL,  -- set by the API now, no longer by the run that set it before (the console's link)
    updated_at = now()
WHERE t.kind <> 'approval_expiry'
  AND NOT (t.done AND EXCLUDED.every_seconds IS NULL AND EXCLUDED.cron IS NULL
           AND t.handled_through IS NOT NULL AND EXCLUDED.due <= t.handled_through)
RETURNING t.*, (xmax = 0) AS created

-- name: timer_get
-- One timer as stored.
SELECT * FROM timers WHERE user_id = %(user_id)s AND id = %(id)s

-- name: timers_list
-- A user's timers in id order, live ones only unless include_done; keyset-paged by id.
SELECT * FROM timers
WHERE user_id = %(user_id)s
  AND (%(include_done)s OR NOT done)
  AND id > %(after)s
ORDER BY id
LIMIT %(limit)s

-- name: timer_cancel
-- DELETE: a live timer the caller owns becomes done and cancelled (approval expiries follow their approval instead).
UPDATE timers
SET done = true, cancelled_at = now(), updated_at = now()
WHERE user_id = %(user_id)s AND id = %(id)s AND NOT done AND kind <> 'approval_expiry'
RETURNING id

-- name: timers_claim_due
-- The scheduler's batch: live timers due at %(now)s, oldest first, locked until the pass commits.
WITH due AS (
    SELECT user_id, id
    FROM timers
    WHERE NOT done AND due <= %(now)s
    ORDER BY due
    LIMIT %(limit)s
    -- The lock is held while the pass waits for the broker's acknowledgement. SKIP LOCKED lets
    -- another replica take the next due rows instead of queueing behind those (and then
    -- re-reading them already advanced), so replicas share a backlog without double-firing.
    FOR UPDATE SKIP LOCKED
)
SELECT t.*
FROM timers t JOIN due USING (user_id, id)
ORDER BY t.due, t.user_id, t.id

-- name: timers_apply
-- Commit one pass's plans in one statement: each row only if it is still live with the due the pass planned from.
UPDATE timers AS t
SET due = COALESCE(u.next_due, t.due),
    done = u.done,
    skipped = u.skipped,
    fired_count = t.fired_count + u.fired,
    last_fired_at = CASE WHEN u.fired > 0 THEN %(now)s ELSE t.last_fired_at END,
    handled_through = GREATEST(t.handled_through, u.handled_through),
    updated_at = now()
FROM unnest(%(user_ids)s::text[], %(ids)s::text[], %(expected_dues)s::timestamptz[],
            %(next_dues)s::timestamptz[], %(dones)s::boolean[], %(skippeds)s::boolean[],
            %(fireds)s::integer[], %(handled)s::timestamptz[])
     AS u(user_id, id, expected_due, next_due, done, skipped, fired, handled_through)
WHERE t.user_id = u.user_id AND t.id = u.id AND t.due = u.expected_due AND NOT t.done
RETURNING t.user_id, t.id

-- name: timer_set_aside
-- A row the scheduler cannot plan (a zone or cron that no longer parses): done, with the reason, so it stops blocking the batch.
UPDATE timers
SET done = true, error = %(error)s, updated_at = now()
WHERE user_id = %(user_id)s AND id = %(id)s AND due = %(expected_due)s AND NOT done
RETURNING id

-- name: timers_due_count
-- The due backlog at %(now)s (the gauge, and the start-up report).
SELECT count(*) AS due, min(due) AS oldest
FROM timers
WHERE NOT done AND due <= %(now)s

-- name: timers_quota_lock
-- Serialise timer creation per user, then per API token, until commit, so two concurrent creates cannot both pass VIGIL_MAX_TIMERS_PER_USER or VIGIL_TIMER_QUOTA_PER_TOKEN (a statement of its own: the counts must take their snapshot after the locks are held). Always user first, then token: one order, no deadlock.
SELECT pg_advisory_xact_lock(hashtextextended('vigil.timers:' || %(user_id)s, 0)) AS user_lock,
       pg_advisory_xact_lock(hashtextextended('vigil.timers.token:' || %(token_id)s, 0)) AS token_lock

-- name: timers_live_counts
-- Live timers other than the one being (re-)registered: the user's, and the token's over all users (the quotas' counts).
SELECT count(*) FILTER (WHERE user_id = %(user_id)s) AS of_user,
       count(*) FILTER (WHERE token_id = %(token_id)s) AS of_token
FROM timers
WHERE NOT done
  AND (user_id = %(user_id)s OR token_id = %(token_id)s)
  AND NOT (user_id = %(user_id)s AND id = %(id)s)
