-- Recovery from a ledger that lost its last commits: its own consumer positions, and claims no live run holds.

-- name: record_positions
-- In the record transaction, after record_events: each partition's next offset, covering exactly the events that transaction recorded. GREATEST: a worker that lost the partition and commits a late batch never moves the position back.
INSERT INTO consumer_positions AS c (topic, partition, next_offset)
SELECT * FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(next_offsets)s::bigint[])
ON CONFLICT (topic, partition) DO UPDATE
SET next_offset = greatest(c.next_offset, EXCLUDED.next_offset), updated_at = now()
WHERE EXCLUDED.next_offset > c.next_offset

-- name: read_positions
-- On assignment: where the ledger says each partition's consumption resumes (no row: the ledger never recorded from it).
SELECT c.topic, c.partition, c.next_offset
FROM consumer_positions c
JOIN unnest(%(topics)s::text[], %(partitions)s::int[]) AS w(topic, partition)
  ON c.topic = w.topic AND c.partition = w.partition

-- name: release_orphaned_claims
-- Claims no live run holds (a finish whose commit the ledger lost, a run this process forgot): claims at this worker's current epochs of users with no run in flight here (%(busy)s) are deleted and their events wait again, counted as lost with their worker exactly as hand_back_stale_claims counts them.
WITH owned AS (
    -- FOR SHARE, as in claim: fenced by the epochs (a takeover waits, a stale epoch matches
    -- nothing), locks in one global order.
    SELECT p.topic, p.partition, p.epoch FROM partitions p
    JOIN unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
      ON p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch
    ORDER BY p.topic, p.partition
    FOR SHARE OF p
),
orphaned AS (
    -- Through claims_by_epoch: one row per run in flight on the owned partitions.
    DELETE FROM claims c USING owned o
    WHERE c.topic = o.topic AND c.partition = o.partition AND c.epoch = o.epoch
      AND c.user_id <> ALL(%(busy)s::text[])
    RETURNING c.user_id, c.partition, c.epoch, c.event_ids
)
UPDATE event_rows e
SET claim_epoch = NULL,
    attempts = CASE WHEN e.attempts + 1 >= %(max_attempts)s AND e.lost_claims = 0 THEN %(max_attempts)s - 1 ELSE e.attempts + 1 END,
    lost_claims = e.lost_claims + 1,
    error = 'claim abandoned: no live run held it on partition ' || x.partition || ' (epoch ' || x.epoch || ')',
    next_attempt_at = now() + make_interval(secs => least(%(backoff_cap)s, %(backoff_base)s * power(2, greatest(e.attempts, 0))) * (0.5 + random() / 2))
FROM orphaned x CROSS JOIN LATERAL unnest(x.event_ids) AS i(id)
WHERE e.id = i.id AND e.user_id = x.user_id AND e.status IN ('pending', 'running')
RETURNING e.id, e.user_id
