-- Events: recording, and what operators read and write (`vigil inbox`, `vigil dead`). The claim
-- rules are in claims.sql, the finish in finish.sql.

-- name: record_staging
-- The consumer's staging table, one per connection, emptied at every commit: a polled batch is copied into it, then record_events moves it.
CREATE TEMP TABLE IF NOT EXISTS incoming_events (
    n           integer,       -- position in the polled batch: ids follow it, so a user's events keep their order
    user_id     text, source text, source_id text, kind text, payload text, session_id text, headers jsonb,
    occurred_at timestamptz, received_at timestamptz, kafka_topic text, kafka_partition integer, kafka_offset bigint
) ON COMMIT DELETE ROWS

-- name: record_copy
-- A polled batch into the staging table. Binary COPY: no SQL literal built per value, which cost the consumer more than the insert itself.
COPY incoming_events (n, user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at,
                      kafka_topic, kafka_partition, kafka_offset) FROM STDIN (FORMAT BINARY)

-- name: record_events
-- One statement per polled batch, after its COPY into the staging table: new users' home partitions (the partition of the first event seen, fixed from then on; only for %(unknown_users)s, those the worker has not seen committed); every event whose dedup key is new in event_keys (retried webhook, redelivered message, replayed timer: dropped, also after the first copy's partition was dropped); and each partition's next offset in consumer_positions, covering exactly the events this statement recorded (GREATEST: a worker that lost the partition and commits a late batch never moves the position back). Returns how many were new.
WITH new_users AS (
    INSERT INTO users (user_id, home_topic, home_partition)
    SELECT DISTINCT ON (user_id) user_id, kafka_topic, kafka_partition FROM incoming_events
    WHERE user_id = ANY(%(unknown_users)s::text[])
    ORDER BY user_id, n
    ON CONFLICT (user_id) DO NOTHING
),
new_keys AS (
    -- The key table's primary key decides; of two copies in one batch the first stands.
    INSERT INTO event_keys (user_id, source, source_id)
    SELECT user_id, source, source_id FROM incoming_events ORDER BY n
    ON CONFLICT (user_id, source, source_id) DO NOTHING
    RETURNING user_id, source, source_id
),
firsts AS (
    SELECT DISTINCT ON (i.user_id, i.source, i.source_id) i.*
    FROM incoming_events i JOIN new_keys k USING (user_id, source, source_id)
    ORDER BY i.user_id, i.source, i.source_id, i.n
),
recorded AS (
    INSERT INTO events (user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at,
                        kafka_topic, kafka_partition, kafka_offset)
    SELECT user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at,
           kafka_topic, kafka_partition, kafka_offset
    FROM firsts ORDER BY n
    RETURNING 1
),
positions AS (
    INSERT INTO consumer_positions AS c (topic, partition, next_offset)
    SELECT * FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(next_offsets)s::bigint[])
    ON CONFLICT (topic, partition) DO UPDATE
    SET next_offset = greatest(c.next_offset, EXCLUDED.next_offset), updated_at = now()
    WHERE EXCLUDED.next_offset > c.next_offset
)
SELECT count(*)::int AS recorded FROM recorded

-- name: oldest_pending_age
-- Age in seconds of the oldest pending event (a stuck or starved agent shows here first), and
-- how many are pending (the same scan of the pending rows answers both).
SELECT coalesce(extract(epoch FROM now() - min(recorded_at)), 0)::float8 AS age, count(*) AS pending
FROM events WHERE status = 'pending'

-- name: dead_list
-- Dead events, newest first, for operators.
SELECT id, user_id, source, source_id, kind, attempts, error, finished_at, received_at
FROM events WHERE status = 'dead' ORDER BY finished_at DESC, id DESC LIMIT %(limit)s

-- name: dead_retry
-- An operator sends dead events back: pending, attempts reset, who and when recorded.
UPDATE events
SET status = 'pending', attempts = 0, transient_failures = 0, lost_claims = 0, finished_at = NULL, next_attempt_at = NULL,
    claim_epoch = NULL, retried_by = %(actor)s, retried_at = now()
WHERE id = ANY(%(ids)s) AND status = 'dead'
RETURNING id, user_id

-- name: inbox
-- A user's events and their states, newest first: the live queue through its partial indexes (it has no index of every row by user: one less index entry on every record and claim), the finished days through events_finished_by_user.
SELECT id, source, source_id, kind, status, attempts, lost_claims, claim_epoch, error, received_at, recorded_at, finished_at, run_id
FROM (
    SELECT * FROM events WHERE user_id = %(user_id)s AND status = 'pending'
    UNION ALL
    SELECT * FROM events WHERE user_id = %(user_id)s AND status = 'running'
    UNION ALL
    (SELECT * FROM events WHERE user_id = %(user_id)s AND status IN ('done', 'dead') ORDER BY id DESC LIMIT %(limit)s)
) mine
ORDER BY id DESC LIMIT %(limit)s
