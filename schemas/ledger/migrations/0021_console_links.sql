-- 0021: what the operator console needs to link a run to what it did, and to find an event
-- by its source id alone.
--
-- A run's tool calls (the issue asks for them beside tokens; vigil_tool_calls_total has no
-- user or run). Written by the finish's insert of the run row.
ALTER TABLE runs ADD COLUMN tool_calls integer NOT NULL DEFAULT 0;
-- The run whose finish last wrote the row. Matching by the finish instant (the console's
-- former rule) attributed a timer that a later run re-set to both runs, and breaks whenever
-- two finishes share a microsecond; the id cannot. NULL: written by the API, an operator, or
-- before this migration. No foreign key: retention prunes runs long before timers, memory
-- files and tasks go (the same as approvals.run_id).
ALTER TABLE timers ADD COLUMN run_id bigint;
ALTER TABLE memory ADD COLUMN run_id bigint;
ALTER TABLE tasks ADD COLUMN run_id bigint;
-- Search by source id without the user (a webhook's delivery id, a message id from a log):
-- the dedup key's primary key starts with the user, so this was a scan of the newest events.
-- On the key table, not on events: event_keys is insert-only (one entry per event recorded,
-- never updated), where an index on events would add an entry to every record, claim,
-- release and finish of the hot path (measured in docs/console.md). The key gives the user,
-- whose events are then read through their own indexes.
CREATE INDEX event_keys_by_source_id ON event_keys (source_id);

-- Rows written before this migration: the console used to match them to runs by the finish
-- instant (the finish is one transaction, so runs.finished_at equals the rows' now()). Keep
-- that history linked where the instant names exactly one run of the user; where two runs
-- share it (one group commit), leave run_id NULL rather than guess. One pass over runs.
CREATE TEMPORARY TABLE single_finish ON COMMIT DROP AS
SELECT user_id, finished_at, min(id) AS id FROM runs GROUP BY user_id, finished_at HAVING count(*) = 1;
CREATE INDEX ON single_finish (user_id, finished_at);
ANALYZE single_finish;
-- A timer's updated_at is its latest set (a run's, or the scheduler advancing it, which no
-- run matches); failing that, the run that created it.
UPDATE timers t SET run_id = coalesce(
    (SELECT s.id FROM single_finish s WHERE s.user_id = t.user_id AND s.finished_at = t.updated_at),
    (SELECT s.id FROM single_finish s WHERE s.user_id = t.user_id AND s.finished_at = t.created_at));
UPDATE memory m SET run_id = s.id FROM single_finish s WHERE s.user_id = m.user_id AND s.finished_at = m.updated_at;
UPDATE tasks k SET run_id = s.id
FROM single_finish s
WHERE s.user_id = k.user_id AND s.finished_at = k.created_at AND k.parent_task_id IS NULL;
