-- Fencing: one active run per user. Read services/vigil/worker/fencing.py for the rule.
--
-- Time: coalesce(%(now)s, now()) is the caller's clock (vigil.clock), the database's only
-- when the caller passes none; stamps of record (finished_at, claimed_at, acquired_at) are
-- the database's own (docs/architecture.md, "Time").

-- name: take_over_partition
-- An assignment is a takeover: bump the epoch. Waits for in-flight claims/finishes that hold the row FOR SHARE.
INSERT INTO partitions AS p (topic, partition, epoch, holder, acquired_at)
VALUES (%(topic)s, %(partition)s, 1, %(holder)s, now())
ON CONFLICT (topic, partition) DO UPDATE
SET epoch = p.epoch + 1, holder = EXCLUDED.holder, acquired_at = now(), handover_until = NULL
RETURNING epoch

-- name: begin_handover
-- A revoke with runs in flight: the partitions (still at these epochs) get a hand-over deadline %(seconds)s from now, which the next owner's takeover waits for. Returns the partitions it was set on.
UPDATE partitions p
SET handover_until = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(seconds)s)
FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
WHERE p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch
RETURNING p.topic, p.partition

-- name: end_handover
-- The revoking owner's last run of these partitions is gone: the next takeover need not wait (a no-op once it happened: the epoch moved on).
UPDATE partitions p
SET handover_until = NULL
FROM unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
WHERE p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch AND p.handover_until IS NOT NULL

-- name: handover_left
-- Seconds until the last of these partitions' hand-over deadlines (NULL: none in progress), on the ledger's clock.
SELECT extract(epoch FROM max(p.handover_until) - coalesce(%(now)s::timestamptz, now()))::float8 AS seconds
FROM partitions p
JOIN unnest(%(topics)s::text[], %(partitions)s::int[]) AS w(topic, partition)
  ON p.topic = w.topic AND p.partition = w.partition
WHERE p.handover_until > coalesce(%(now)s::timestamptz, now())

-- name: hand_back_stale_claims
-- Claims made under an older epoch of this partition belong to a worker that lost it: back to pending, with a backoff. Their attempt counts (the worker may have crashed on them), except that a claim lost in company never uses up the last attempt: only a claim that ran alone (an event lost before, on its last attempt: claim rule 3) can make a crash an event's death, and that verdict (or a batch's, replayed alone: its journal's stamp) waits %(verdict_s)s for the worker to come back alive and say it was no crash (forgive_lost_claims).
UPDATE events e
SET status = 'pending',
    -- Kept: which claim was lost (the epoch of the worker that held it), until a claim,
    -- release or finish writes the row again. forgive_lost_claims matches on it.
    claim_epoch = e.claim_epoch,
    -- attempts >= max after a claim means the claim was for the last attempt; it ran alone
    -- exactly when the event had been lost before (the claim rules choose so).
    attempts = CASE WHEN e.attempts >= %(max_attempts)s AND e.lost_claims = 0 THEN %(max_attempts)s - 1 ELSE e.attempts END,
    lost_claims = e.lost_claims + 1,
    error = 'claim abandoned: its worker lost partition ' || %(partition)s || ' (epoch ' || e.claim_epoch || ')',
    -- The backoff of vigil.retry.backoff (jitter 0.5 to 1), per row: change the two together.
    -- A lone last attempt's: the verdict's wait instead (mark_exhausted_dead waits for it). A
    -- batch replayed alone (its lead at max - 1, its journal stamped): at least that wait, or
    -- its next lone attempt would take the stamp for a crash alone and drop the journal.
    next_attempt_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => CASE
        WHEN e.lost_claims > 0 AND e.attempts >= %(max_attempts)s THEN %(verdict_s)s
        ELSE greatest(
            CASE WHEN e.lost_claims > 0 AND e.attempts = %(max_attempts)s - 1
                      AND EXISTS (SELECT 1 FROM run_journal j
                                  WHERE j.user_id = e.user_id AND j.step = 1 AND j.finished_at IS NULL
                                    AND j.alone_at IS NOT NULL
                                    AND j.lead_event = e.id)
                 THEN %(verdict_s)s ELSE 0 END,
            least(%(backoff_cap)s, %(backoff_base)s * power(2, greatest(e.attempts - 1, 0))) * (0.5 + random() / 2))
        END)
FROM users u
WHERE u.user_id = e.user_id
  AND u.home_topic = %(topic)s AND u.home_partition = %(partition)s
  AND e.status = 'running' AND e.claim_epoch < %(epoch)s
RETURNING e.id

-- name: lock_epochs
-- Finish: lock the partition rows FOR SHARE (a takeover's UPDATE waits for this transaction) and read their epochs.
SELECT p.topic, p.partition, p.epoch
FROM partitions p
JOIN unnest(%(topics)s::text[], %(partitions)s::int[]) AS w(topic, partition)
  ON p.topic = w.topic AND p.partition = w.partition
ORDER BY p.topic, p.partition
FOR SHARE OF p
