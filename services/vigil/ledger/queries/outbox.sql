-- Outbox: the dispatcher's claim, its outcomes, and the operators' views.
--
-- Every time comparison uses %(now)s, the dispatcher's clock, never now(): one clock decides
-- gaps, backoffs and send leases, and tests move it. Rows of one delivery share delivery_id
-- and every update after the claim is by delivery_id, so they always move together.
-- Pacing state lives in users (last_delivery_at, urgent_day, urgent_count) and is only read
-- and written while that users row is locked by the claim: that lock is what keeps two
-- dispatchers from giving one user two deliveries inside a gap.
--
-- The statements that address rows by id or by delivery id spell their status checks so that
-- they imply no partial index's predicate ("sending" as IN ('sending', 'delivered') AND <>
-- 'delivered'): the outbox is usually analyzed while nothing is unfinished, and with such
-- statistics the planner otherwise scans all of outbox_undelivered for every delivery it
-- records (quadratic over a backlog), where the primary key or outbox_by_delivery finds the
-- few rows (tests/test_dispatcher_plans.py).

-- name: outbox_lock_due_users
-- Lock up to %(limit)s users who may have something to send now, with their pacing state and channel. Two ways of finding them: with %(fresh_after)s NULL, a sweep: users in user_id order after %(after)s, a round-robin cursor, so a pass costs a few index probes per user it looks at and stops once it has enough, however many wait; with %(fresh_after)s an outbox id, only users with unfinished rows among the next %(fresh_max)s ids after it, the ids in %(gaps)s, and the users in %(recheck)s (new messages between sweeps: a sweep reads every user that holds messages). One row more or less: the cursor of the next sweep's claim ('' once the sweep reached the last user) and the outbox's highest id in this statement's snapshot, and the probed ids with no row (between sweeps) first, the rest NULL when nothing was locked; after those, between sweeps, a row per user looked at whose messages are not due yet, with wake_at (when that may change) and user_id only.
-- Every step is a probe for the user at hand whatever the statistics say. The outbox is
-- usually analyzed while the dispatcher keeps up (nothing pending); with such statistics a
-- correlated NOT EXISTS once rescanned every unfinished row for each held one (4 million
-- rows, 0.3 s, for a burst of 2,000 messages), and a pass that read every unfinished row made
-- draining a backlog quadratic (tests/test_dispatcher_plans.py).
WITH RECURSIVE waiting (user_id) AS (
    -- Users with unfinished rows after the cursor, skipping through outbox_undelivered one
    -- user at a time. Evaluated lazily: the LIMIT in due stops it once enough users are due.
    (SELECT user_id FROM outbox
     WHERE %(fresh_after)s::bigint IS NULL AND status IN ('pending', 'sending') AND user_id > %(after)s
     ORDER BY user_id LIMIT 1)
    UNION ALL
    SELECT (SELECT o.user_id FROM outbox o
            WHERE o.status IN ('pending', 'sending') AND o.user_id > w.user_id ORDER BY o.user_id LIMIT 1)
    FROM waiting w WHERE w.user_id IS NOT NULL
),
probed AS MATERIALIZED (
    -- The outbox ids a claim between sweeps looks at: those written after %(fresh_after)s (at
    -- most %(fresh_max)s ids on) and %(gaps)s, lower ids that an earlier claim found missing
    -- (a transaction that took its ids before a later one committed, still open then).
    SELECT ARRAY(SELECT generate_series(%(fresh_after)s::bigint + 1,
                                        least((SELECT max(id) FROM outbox), %(fresh_after)s::bigint + %(fresh_max)s)))
           || %(gaps)s::bigint[] AS ids
),
fresh AS MATERIALIZED (
    -- Each probed by its primary key: a range condition would leave the choice to the
    -- statistics, and an outbox analyzed nearly empty once made it a scan of the whole table.
    SELECT o.id, o.user_id, o.status FROM outbox o
    WHERE o.id = ANY((SELECT ids FROM probed)::bigint[])
),
candidates AS (
    SELECT user_id FROM waiting WHERE user_id IS NOT NULL
    UNION ALL
    -- With them the users named in %(recheck)s: whose delivery just ended, so that messages
    -- written while it was in flight are looked at now, not at the next sweep.
    (SELECT user_id FROM fresh WHERE status IN ('pending', 'sending')
     UNION
     SELECT unnest(%(recheck)s::text[])
     ORDER BY user_id)
),
looked AS NOT MATERIALIZED (
    -- A fixed delivery whose backoff (pending) or send lease (sending) has run out; or held
    -- messages whose gap has passed, or among which one is urgent (the plan checks the urgent
    -- cap), of a user with no delivery in flight: due. Only a prefilter, so that users waiting
    -- out their gap (the normal state) are neither locked nor fill the limit:
    -- vigil.dispatcher.pacing.plan decides, on rows read after the lock is held. Otherwise
    -- the moment that may change (wake_at): the backoff's or lease's end, or the gap's.
    -- The user's unfinished rows summed up (a row without a delivery id is held: a sending
    -- row always has one), the user and the channel by primary key (LIMIT 1: never a join
    -- that starts from every user or every channel). NOT MATERIALIZED: due and waits each
    -- read it on their own, so a sweep's due stays lazy (it stops at its limit) and its
    -- waits, ruled out by its first condition, reads nothing (materialized, a sweep over
    -- 100,000 held users took 10-15 percent longer).
    SELECT w.user_id, s.unfinished,
           (s.fixed_due
            OR (NOT s.in_flight
                AND (s.urgent_held OR u.last_delivery_at IS NULL OR g.gap_end <= %(now)s))) AS is_due,
           CASE WHEN s.in_flight THEN s.fixed_next ELSE g.gap_end END AS wake_at
    FROM candidates w
    CROSS JOIN LATERAL (
        SELECT count(*) AS unfinished,
               bool_or(o.delivery_id IS NOT NULL AND o.next_attempt_at <= %(now)s) AS fixed_due,
               bool_or(o.delivery_id IS NOT NULL) AS in_flight,
               min(o.next_attempt_at) FILTER (WHERE o.delivery_id IS NOT NULL) AS fixed_next,
               bool_or(o.urgent) FILTER (WHERE o.delivery_id IS NULL) AS urgent_held
        FROM outbox o WHERE o.user_id = w.user_id AND o.status IN ('pending', 'sending')
    ) s
    CROSS JOIN LATERAL (
        SELECT u.last_delivery_at, u.attention_gap_s FROM users u WHERE u.user_id = w.user_id LIMIT 1
    ) u
    LEFT JOIN LATERAL (SELECT c.gap_seconds FROM channels c WHERE c.user_id = w.user_id LIMIT 1) c ON true
    CROSS JOIN LATERAL (
        SELECT u.last_delivery_at
               + make_interval(secs => coalesce(c.gap_seconds, u.attention_gap_s, %(default_gap)s)) AS gap_end
    ) g
),
due AS (
    SELECT user_id FROM looked WHERE is_due LIMIT %(limit)s
),
waits AS (
    -- Between sweeps, the users looked at that hold messages not due yet, with the moment to
    -- look again (the loop keeps it; a sweep reports none: it reads every holder anyway).
    SELECT user_id, wake_at FROM looked
    WHERE %(fresh_after)s::bigint IS NOT NULL AND unfinished > 0 AND NOT coalesce(is_due, false) AND wake_at IS NOT NULL
),
locked AS (
    SELECT u.user_id, u.last_delivery_at, u.urgent_day, u.urgent_count, u.attention_gap_s
    FROM users u
    WHERE u.user_id = ANY(ARRAY(SELECT user_id FROM due))
    ORDER BY u.user_id
    -- SKIP LOCKED: a user another dispatcher is claiming right now is its business this
    -- pass; waiting for that lock would only serialise the replicas. Held until commit, so
    -- the pacing state read here cannot change under this claim.
    FOR UPDATE SKIP LOCKED
),
next AS (
    -- A full pass continues after its last due user; a short one reached the end of the sweep.
    -- The probed ids with no row (yet): the next claim looks at them again.
    SELECT CASE WHEN count(*) >= %(limit)s THEN max(user_id) ELSE '' END AS cursor,
           (SELECT max(id) FROM outbox) AS high,
           ARRAY(SELECT unnest(ids) FROM probed EXCEPT SELECT id FROM fresh) AS missing
    FROM due
)
SELECT n.cursor, n.high, n.missing, l.user_id, l.last_delivery_at, l.urgent_day, l.urgent_count,
       c.type, c.url, c.secret, c.sealed_with, c.gap_seconds, c.urgent_daily_cap, l.attention_gap_s,
       NULL::timestamptz AS wake_at
FROM next n
LEFT JOIN locked l ON true
LEFT JOIN LATERAL (
    SELECT c.type, c.url, c.secret, c.sealed_with, c.gap_seconds, c.urgent_daily_cap FROM channels c WHERE c.user_id = l.user_id LIMIT 1
) c ON true
UNION ALL
SELECT NULL, NULL, NULL, w.user_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, w.wake_at
FROM waits w
ORDER BY wake_at NULLS FIRST, user_id

-- name: outbox_unfinished_for_users
-- The unfinished rows (pending, sending) of locked users, oldest first: every row of a fixed delivery, the oldest %(max_messages)s held.
SELECT id, user_id, run_id, body, urgent, created_at, status, delivery_id, attempts, next_attempt_at, fixed_at,
       session_id, deadline, traceparent, actions
FROM (
    SELECT o.*, row_number() OVER (PARTITION BY o.user_id, o.delivery_id ORDER BY o.id) AS n
    FROM outbox o
    WHERE o.user_id = ANY(%(users)s) AND o.status IN ('pending', 'sending')
) ranked
WHERE n <= %(max_messages)s OR delivery_id IS NOT NULL
ORDER BY user_id, id

-- name: outbox_fix_deliveries
-- Fix a delivery id on held rows before anything is sent (pending -> sending, lease until %(lease_until)s).
UPDATE outbox o
SET status = 'sending', delivery_id = f.delivery_id, fixed_at = %(now)s, attempts = o.attempts + 1,
    next_attempt_at = %(lease_until)s, channel = f.channel, error = NULL
FROM unnest(%(ids)s::bigint[], %(delivery_ids)s::uuid[], %(channels)s::text[]) AS f(id, delivery_id, channel)
WHERE o.id = f.id AND o.status IN ('pending', 'delivered') AND o.status <> 'delivered' AND o.delivery_id IS NULL
RETURNING o.id

-- name: outbox_record_pacing
-- A new delivery restarts the user's gap; a bypass of it counts against today's urgent cap; the earned gap adapts to whether the person replied to the previous delivery. Compare-and-set on the state the plan read.
-- A reply is a chat event received after the previous delivery, within %(window)s seconds and
-- before now (events by user: the events_*_by_user indexes; one probe per new delivery, and
-- only while adapting: without it the statement reads no event).
-- Adapting (%(adapt)s, not pinned): the first gap is the quiet end %(max_gap)s; a reply halves
-- it, no reply doubles it, within %(min_gap)s..%(max_gap)s. RETURNING: whether the previous
-- delivery was answered (NULL: there was none, or not adapting) and the day count it replaced, for metrics.
WITH prev AS (
    SELECT u.user_id, u.delivery_day, u.delivery_day_count,
           CASE WHEN u.last_delivery_at IS NULL OR NOT (%(adapt)s AND NOT u.attention_pinned) THEN NULL ELSE (
               -- One probe per partial index by user (pending, running, finished): never a
               -- scan of the live events, whatever their statistics.
               EXISTS (SELECT 1 FROM events_live e
                       WHERE e.user_id = u.user_id AND e.status = 'pending' AND e.source = 'chat'
                         AND e.received_at > u.last_delivery_at
                         AND e.received_at <= least(u.last_delivery_at + make_interval(secs => %(window)s), %(now)s))
               OR EXISTS (SELECT 1 FROM events_live e
                          WHERE e.user_id = u.user_id AND e.status = 'running' AND e.source = 'chat'
                            AND e.received_at > u.last_delivery_at
                            AND e.received_at <= least(u.last_delivery_at + make_interval(secs => %(window)s), %(now)s))
               OR EXISTS (SELECT 1 FROM events_finished e
                          WHERE e.user_id = u.user_id AND e.source = 'chat'
                            AND e.received_at > u.last_delivery_at
                            AND e.received_at <= least(u.last_delivery_at + make_interval(secs => %(window)s), %(now)s))
           ) END AS replied,
           (%(adapt)s AND NOT u.attention_pinned) AS adapting, p.bypass
    FROM unnest(%(users)s::text[], %(seen)s::timestamptz[], %(bypass)s::boolean[]) AS p(user_id, seen, bypass)
    JOIN users u ON u.user_id = p.user_id AND u.last_delivery_at IS NOT DISTINCT FROM p.seen
)
UPDATE users u
SET last_delivery_at = %(now)s,
    urgent_day = CASE WHEN p.bypass THEN %(today)s::date ELSE u.urgent_day END,
    urgent_count = CASE WHEN NOT p.bypass THEN u.urgent_count
                        WHEN u.urgent_day = %(today)s::date THEN u.urgent_count + 1
                        ELSE 1 END,
    attention_gap_s = CASE WHEN NOT p.adapting THEN u.attention_gap_s
                           WHEN u.attention_gap_s IS NULL OR p.replied IS NULL THEN %(max_gap)s
                           WHEN p.replied THEN greatest(%(min_gap)s, least(%(max_gap)s, u.attention_gap_s / 2))
                           ELSE least(%(max_gap)s, greatest(%(min_gap)s, u.attention_gap_s * 2)) END,
    attention_reason = CASE WHEN NOT p.adapting THEN u.attention_reason
                            WHEN u.attention_gap_s IS NULL OR p.replied IS NULL THEN 'start: the quiet end'
                            WHEN p.replied THEN 'replied within the window: halved'
                            ELSE 'previous message unanswered: doubled' END,
    attention_at = CASE WHEN p.adapting THEN %(now)s ELSE u.attention_at END,
    delivery_day = %(today)s::date,
    delivery_day_count = CASE WHEN u.delivery_day = %(today)s::date THEN u.delivery_day_count + 1 ELSE 1 END
FROM prev p
WHERE u.user_id = p.user_id
RETURNING u.user_id, p.replied, p.delivery_day AS previous_day, p.delivery_day_count AS previous_day_count

-- name: outbox_claim_retries
-- Send fixed deliveries again under their own ids: a retry whose backoff ended, or a send whose lease ran out.
-- Each row finds its channel by a lookup in %(channels)s (a JSON object by delivery id), not by
-- a join with the ids: that join compared every row with every id, or hashed the whole table.
UPDATE outbox o
SET status = 'sending', attempts = o.attempts + 1, next_attempt_at = %(lease_until)s,
    channel = %(channels)s::jsonb ->> o.delivery_id::text
WHERE o.delivery_id = ANY(%(delivery_ids)s::uuid[]) AND o.status IN ('pending', 'sending', 'delivered')
  AND o.status <> 'delivered' AND o.next_attempt_at <= %(now)s
RETURNING o.id, o.delivery_id, o.attempts

-- name: outbox_bury_lost
-- A delivery that used its last attempt without any outcome recorded (its dispatchers kept dying mid-send) is dead.
UPDATE outbox
SET status = 'dead', dead_at = %(now)s, next_attempt_at = NULL,
    error = 'no outcome recorded after ' || attempts || ' attempts (dispatcher lost mid-send)' || coalesce('; last error: ' || error, '')
WHERE delivery_id = ANY(%(delivery_ids)s::uuid[]) AND status IN ('pending', 'sending', 'delivered') AND status <> 'delivered'
  AND next_attempt_at <= %(now)s
RETURNING id, delivery_id

-- name: outbox_mark_delivered
-- The channel accepted these deliveries (%(delivery_ids)s), each at its attempt in %(attempts)s (a JSON object by delivery id): one statement for every outcome that arrived together. A delivery with no rows returned: that attempt's lease was taken over (it went out again).
UPDATE outbox o
SET status = 'delivered', delivered_at = %(now)s, next_attempt_at = NULL, error = NULL
WHERE o.delivery_id = ANY(%(delivery_ids)s::uuid[]) AND o.status IN ('sending', 'delivered') AND o.status <> 'delivered'
  AND o.attempts = (%(attempts)s::jsonb ->> o.delivery_id::text)::int
RETURNING o.delivery_id, o.created_at

-- name: outbox_schedule_retry
-- Attempt %(attempt)s failed and may be retried: back to pending, not before %(next_attempt_at)s.
UPDATE outbox
SET status = 'pending', next_attempt_at = %(next_attempt_at)s, error = %(error)s
WHERE delivery_id = %(delivery_id)s AND status IN ('sending', 'delivered') AND status <> 'delivered'
  AND attempts = %(attempt)s
RETURNING id

-- name: outbox_mark_dead
-- Attempt %(attempt)s failed for good (a final answer, or the last attempt): kept, listed, never sent again.
UPDATE outbox
SET status = 'dead', dead_at = %(now)s, next_attempt_at = NULL, error = %(error)s
WHERE delivery_id = %(delivery_id)s AND status IN ('sending', 'delivered') AND status <> 'delivered'
  AND attempts = %(attempt)s
RETURNING id

-- name: outbox_backlog
-- Undelivered rows by status and the oldest one's creation time (the backlog gauges).
SELECT status, count(*) AS messages, min(created_at) AS oldest
FROM outbox WHERE status IN ('pending', 'sending')
GROUP BY status

-- name: outbox_for_user
-- A user's outbox, newest first (`vigil outbox USER`).
SELECT id, run_id, epoch, created_at, status, urgent, attempts, delivery_id, channel, fixed_at,
       next_attempt_at, delivered_at, dead_at, error, body, session_id, deadline
FROM outbox WHERE user_id = %(user_id)s
ORDER BY id DESC
LIMIT %(limit)s

-- name: outbox_dead_deliveries
-- Dead deliveries, newest first: one row per delivery id (`vigil outbox --dead`, `vigil dead`).
SELECT delivery_id, user_id, max(dead_at) AS dead_at, max(attempts) AS attempts, max(channel) AS channel,
       max(error) AS error, count(*) AS messages, array_agg(id ORDER BY id) AS outbox_ids,
       min(created_at) AS created_at
FROM outbox
WHERE status = 'dead'
GROUP BY delivery_id, user_id
ORDER BY max(dead_at) DESC
LIMIT %(limit)s

-- name: outbox_revive_dead
-- Operator: send a dead delivery again under its own id (dead -> pending, attempts start over).
UPDATE outbox
SET status = 'pending', dead_at = NULL, attempts = 0, next_attempt_at = %(now)s,
    error = 'revived by an operator; before: ' || coalesce(error, '')
WHERE delivery_id = %(delivery_id)s AND status = 'dead'
RETURNING id, user_id

-- name: outbox_delivery_session
-- The conversation a delivery of this user came from (its newest message that names one): ingest resolves a chat message's in_reply_to with it. No row: no such delivery for this user.
SELECT (array_agg(session_id ORDER BY id DESC) FILTER (WHERE session_id IS NOT NULL))[1] AS session_id
FROM outbox WHERE user_id = %(user_id)s AND delivery_id = %(delivery_id)s
HAVING count(*) > 0
