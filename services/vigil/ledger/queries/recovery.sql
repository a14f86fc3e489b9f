-- Recovery from a ledger that lost its last commits: its own consumer positions, and claims no live run holds.
--
-- Time: coalesce(%(now)s, now()) is the caller's clock (vigil.clock), the database's only
-- when the caller passes none; stamps of record (finished_at, claimed_at, acquired_at) are
-- the database's own (docs/architecture.md, "Time").

-- name: read_positions
-- On assignment: where the ledger says each partition's consumption resumes (no row: the ledger never recorded from it).
SELECT c.topic, c.partition, c.next_offset
FROM consumer_positions c
JOIN unnest(%(topics)s::text[], %(partitions)s::int[]) AS w(topic, partition)
  ON c.topic = w.topic AND c.partition = w.partition

-- name: release_orphaned_claims
-- Claims no live run holds (a finish whose commit the ledger lost, a run this process forgot): rows running at this worker's current epochs of users with no run in flight here (%(busy)s) go back to pending, counted as lost with their worker exactly as hand_back_stale_claims counts them.
WITH owned AS (
    -- FOR SHARE, as in claim: fenced by the epochs (a takeover waits, a stale epoch matches
    -- nothing), locks in one global order.
    SELECT p.topic, p.partition, p.epoch FROM partitions p
    JOIN unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
      ON p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch
    ORDER BY p.topic, p.partition
    FOR SHARE OF p
),
orphaned AS MATERIALIZED (
    -- Through events_running_by_user: the running rows only (a few per run slot).
    SELECT e.id, o.partition FROM events e
    JOIN users u ON u.user_id = e.user_id
    JOIN owned o ON o.topic = u.home_topic AND o.partition = u.home_partition AND e.claim_epoch = o.epoch
    -- NOT IN a subquery: hashed once, not every running row compared with every busy user (as in claim).
    WHERE e.status = 'running' AND e.user_id NOT IN (SELECT jsonb_array_elements_text(%(busy)s::jsonb))
)
UPDATE events e
SET status = 'pending',
    claim_epoch = NULL,
    attempts = CASE WHEN e.attempts >= %(max_attempts)s AND e.lost_claims = 0 THEN %(max_attempts)s - 1 ELSE e.attempts END,
    lost_claims = e.lost_claims + 1,
    error = 'claim abandoned: no live run held it on partition ' || x.partition || ' (epoch ' || e.claim_epoch || ')',
    -- The backoff of vigil.retry.backoff (jitter 0.5 to 1), per row: change the two together.
    next_attempt_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => least(%(backoff_cap)s, %(backoff_base)s * power(2, greatest(e.attempts - 1, 0))) * (0.5 + random() / 2))
FROM orphaned x
WHERE e.id = x.id AND e.status = 'running'
RETURNING e.id, e.user_id
