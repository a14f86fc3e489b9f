-- Fencing: one active run per user. Read services/vigil/worker/fencing.py for the rule.

-- name: take_over_partition
-- An assignment is a takeover: bump the epoch. Waits for in-flight claims/finishes that hold the row FOR SHARE.
INSERT INTO partitions AS p (topic, partition, epoch, holder, acquired_at)
VALUES (%(topic)s, %(partition)s, 1, %(holder)s, now())
ON CONFLICT (topic, partition) DO UPDATE
SET epoch = p.epoch + 1, holder = EXCLUDED.holder, acquired_at = now()
RETURNING epoch

-- name: hand_back_stale_claims
-- Claims made under an older epoch of this partition belong to a worker that lost it: their rows go, and their events wait again with a backoff. Their attempt counts (the worker may have crashed on them), except that a claim lost in company never uses up the last attempt: only a claim that ran alone (an event lost before, on its last attempt: claim rule 3) can make a crash an event's death.
WITH lost AS (
    -- Through claims_by_epoch: the claims of this partition only (none, unless a worker lost it).
    DELETE FROM claims c
    WHERE c.topic = %(topic)s AND c.partition = %(partition)s AND c.epoch < %(epoch)s
    RETURNING c.user_id, c.epoch, c.event_ids
)
UPDATE event_rows e
SET claim_epoch = NULL,
    -- The claim's attempt, counted now (the stored row has the attempts before it).
    -- attempts + 1 >= max means the claim was for the last attempt; it ran alone exactly when
    -- the event had been lost before (the claim rules choose so).
    attempts = CASE WHEN e.attempts + 1 >= %(max_attempts)s AND e.lost_claims = 0 THEN %(max_attempts)s - 1 ELSE e.attempts + 1 END,
    lost_claims = e.lost_claims + 1,
    error = 'claim abandoned: its worker lost partition ' || %(partition)s || ' (epoch ' || x.epoch || ')',
    next_attempt_at = now() + make_interval(secs => least(%(backoff_cap)s, %(backoff_base)s * power(2, greatest(e.attempts, 0))) * (0.5 + random() / 2))
FROM lost x CROSS JOIN LATERAL unnest(x.event_ids) AS i(id)
WHERE e.id = i.id AND e.user_id = x.user_id AND e.status IN ('pending', 'running')
RETURNING e.id

-- name: lock_epochs
-- Finish: lock the partition rows FOR SHARE (a takeover's UPDATE waits for this transaction) and read their epochs.
SELECT p.topic, p.partition, p.epoch
FROM partitions p
JOIN unnest(%(topics)s::text[], %(partitions)s::int[]) AS w(topic, partition)
  ON p.topic = w.topic AND p.partition = w.partition
ORDER BY p.topic, p.partition
FOR SHARE OF p
