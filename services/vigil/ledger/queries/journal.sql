-- The run journal: each step of a run appended as it happens, fenced like the finish, read back when the run is claimed again. Read services/vigil/ledger/journal.py for the rules.

-- name: journal_live_many
-- The live (unfinished) run journals of these users, oldest lead first, every step in order: a run's start reads its user's (one run per user at a time; a second journal is an operator's retry of a dead event waiting its turn). Their background tasks' journals (task:tsk_...) are the tasks' own. A journal whose lead event is dead is parked (rule 5): no run reads it until an operator's retry makes that event pending again. The lead is the run key's event id (<user>:<id>, or <user>:<id>~<attempt>: lead_event).
SELECT j.user_id, j.run_key, j.step, j.kind, j.body::text AS body, j.outcome::text AS outcome, j.alone_at
FROM run_journal j
WHERE j.user_id = ANY(%(user_ids)s) AND j.finished_at IS NULL AND NOT starts_with(j.run_key, 'task:tsk_')
  AND NOT EXISTS (SELECT 1 FROM events e
                  WHERE e.id = j.lead_event AND e.status = 'dead')
ORDER BY j.user_id, j.lead_event, j.run_key, j.step

-- name: journal_live_task
-- A background task's live journal, every step in order (its execution's start reads it).
SELECT j.run_key, j.step, j.kind, j.body::text AS body, j.outcome::text AS outcome
FROM run_journal j
WHERE j.run_key = %(run_key)s AND j.finished_at IS NULL
ORDER BY j.step

-- name: journal_append
-- One step of a run, fenced by the claim's epoch: FOR SHARE holds the partition row to commit, so a takeover waits for the append and every later append of the old owner matches no row (no step is written). A step already there (a stale copy) is a conflict: also refused.
INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body)
SELECT %(run_key)s, %(step)s, %(kind)s, %(user_id)s, p.epoch, %(attempt)s, %(body)s::json
FROM partitions p
WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s
FOR SHARE OF p
ON CONFLICT (run_key, step) DO NOTHING

-- name: journal_outcome
-- An action call's outcome, fenced like the append; only a call still in doubt is written.
UPDATE run_journal j SET outcome = %(outcome)s::json, outcome_at = now()
FROM (SELECT 1 FROM partitions p
      WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s
      FOR SHARE OF p) fence
WHERE j.run_key = %(run_key)s AND j.step = %(step)s AND j.kind = 'call' AND j.outcome IS NULL

-- name: journal_task_append
-- One step of a background task, fenced by the task's lease: only its current holder (lease_epoch) of a running task appends.
INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body)
SELECT %(run_key)s, %(step)s, %(kind)s, t.user_id, t.lease_epoch, t.attempts, %(body)s::json
FROM tasks t
WHERE t.id = %(task_id)s AND t.status = 'running' AND t.lease_epoch = %(epoch)s
FOR SHARE OF t
ON CONFLICT (run_key, step) DO NOTHING

-- name: journal_task_outcome
-- A background task's action call outcome, fenced by the task's lease like its append.
UPDATE run_journal j SET outcome = %(outcome)s::json, outcome_at = now()
FROM (SELECT 1 FROM tasks t
      WHERE t.id = %(task_id)s AND t.status = 'running' AND t.lease_epoch = %(epoch)s
      FOR SHARE OF t) fence
WHERE j.run_key = %(run_key)s AND j.step = %(step)s AND j.kind = 'call' AND j.outcome IS NULL

-- name: journal_finish_users
-- In a finish: the live run journals of these users' done runs end, those whose lead event (the run key's id) is one the finish made done. Another journal of the user is left: a dead event's (parked for the operator's retry, rule 5) or a retried one's waiting its turn; their tasks' journals are the tasks' own. Deleted, or kept as finished for VIGIL_RUN_JOURNAL_DAYS.
WITH ended AS (
    DELETE FROM run_journal j
    WHERE j.user_id = ANY(%(user_ids)s) AND j.finished_at IS NULL AND NOT starts_with(j.run_key, 'task:tsk_')
      AND j.lead_event = ANY(%(event_ids)s)
      AND NOT %(keep)s
    RETURNING 1
)
UPDATE run_journal j SET finished_at = now()
WHERE j.user_id = ANY(%(user_ids)s) AND j.finished_at IS NULL AND NOT starts_with(j.run_key, 'task:tsk_')
  AND j.lead_event = ANY(%(event_ids)s)
  AND %(keep)s

-- name: journal_finish_task
-- A background task's terminal write: its journal ends with it (deleted, or kept as finished).
WITH ended AS (
    DELETE FROM run_journal j
    WHERE j.run_key = %(run_key)s AND j.finished_at IS NULL AND NOT %(keep)s
    RETURNING 1
)
UPDATE run_journal j SET finished_at = now()
WHERE j.run_key = %(run_key)s AND j.finished_at IS NULL AND %(keep)s

-- name: journal_discard
-- A journal its run cannot replay (its events are no longer all claimable): dropped, fenced by the epoch of the run that found it.
DELETE FROM run_journal j
USING (SELECT 1 FROM partitions p
       WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s
       FOR SHARE OF p) fence
WHERE j.run_key = %(run_key)s AND j.finished_at IS NULL

-- name: journal_mark_alone
-- A batch's journal taken up by its lead's lone last attempt (claim rule 3): its first step stamped, once, fenced like an append. A journal already stamped is not taken up alone again.
UPDATE run_journal j SET alone_at = now()
FROM (SELECT 1 FROM partitions p
      WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s
      FOR SHARE OF p) fence
WHERE j.run_key = %(run_key)s AND j.step = 1 AND j.finished_at IS NULL AND j.alone_at IS NULL

-- name: journal_steps
-- A run's steps for operators (`vigil runs show`, the console's run page), live or kept: its key's, and those of a later attempt that started over under <key>~<attempt>.
SELECT j.run_key, j.step, j.kind, j.user_id, j.epoch, j.attempt, j.body::text AS body, j.outcome::text AS outcome,
       j.recorded_at, j.outcome_at, j.finished_at
FROM run_journal j
WHERE j.user_id = %(user_id)s AND (j.run_key = %(run_key)s OR starts_with(j.run_key, %(run_key)s || '~'))
ORDER BY j.run_key, j.step
LIMIT %(limit)s

-- name: journal_prune
-- Retention: kept journals past VIGIL_RUN_JOURNAL_DAYS, and live ones left by runs whose events ended otherwise (dead) and older than the dedup window; "now" is the pruner's clock (the ledger's without one).
DELETE FROM run_journal j
WHERE (j.finished_at IS NOT NULL
       AND j.finished_at < coalesce(%(now)s::timestamptz, now()) - make_interval(days => %(keep_days)s))
   OR (j.finished_at IS NULL
       AND j.recorded_at < coalesce(%(now)s::timestamptz, now()) - make_interval(days => %(live_days)s))

-- name: journal_append_many
-- Steps of many runs in one statement (the worker's group append), each fenced by its claim's epoch: the partition rows are held FOR SHARE to commit, in one global order (as lock_epochs does: no deadlock with a takeover); a step whose epoch is no longer current matches no fence row and is not written. Returns the steps written.
WITH w AS (
    -- Every array in binary: as text, psycopg writes each element in Python (see claim_chosen).
    SELECT * FROM unnest(%(run_keys)b::text[], %(steps)b::int[], %(kinds)b::text[], %(user_ids)b::text[],
                         %(topics)b::text[], %(partitions)b::int[], %(epochs)b::bigint[], %(attempts)b::int[],
                         %(bodies)b::text[])
             AS w(run_key, step, kind, user_id, topic, partition, epoch, attempt, body)
),
fence AS (
    SELECT p.topic, p.partition, p.epoch FROM partitions p
    WHERE (p.topic, p.partition, p.epoch) IN (SELECT DISTINCT w.topic, w.partition, w.epoch FROM w)
    ORDER BY p.topic, p.partition
    FOR SHARE OF p
)
INSERT INTO run_journal (run_key, step, kind, user_id, epoch, attempt, body)
SELECT w.run_key, w.step, w.kind, w.user_id, w.epoch, w.attempt, w.body::json
FROM w JOIN fence f ON f.topic = w.topic AND f.partition = w.partition AND f.epoch = w.epoch
ON CONFLICT (run_key, step) DO NOTHING
RETURNING run_key, step

-- name: journal_outcome_many
-- Outcomes of many runs' calls in one statement, fenced like journal_append_many; only calls still in doubt are written. Returns the steps written.
WITH w AS (
    SELECT * FROM unnest(%(run_keys)b::text[], %(steps)b::int[], %(topics)b::text[], %(partitions)b::int[],
                         %(epochs)b::bigint[], %(outcomes)b::text[])
             AS w(run_key, step, topic, partition, epoch, outcome)
),
fence AS (
    SELECT p.topic, p.partition, p.epoch FROM partitions p
    WHERE (p.topic, p.partition, p.epoch) IN (SELECT DISTINCT w.topic, w.partition, w.epoch FROM w)
    ORDER BY p.topic, p.partition
    FOR SHARE OF p
)
UPDATE run_journal j SET outcome = w.outcome::json, outcome_at = now()
FROM w JOIN fence f ON f.topic = w.topic AND f.partition = w.partition AND f.epoch = w.epoch
WHERE j.run_key = w.run_key AND j.step = w.step AND j.kind = 'call' AND j.outcome IS NULL
RETURNING j.run_key, j.step
