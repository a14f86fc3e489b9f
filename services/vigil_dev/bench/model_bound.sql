-- The model-bound workload's statements (bench/model_bound.py), loaded by name like the ledger's.

-- name: model_bound_runs_done
-- Progress: runs finished so far (the workload's database holds only its own runs).
SELECT count(*)::int AS n FROM runs

-- name: model_bound_runs
-- Every run's start and finish as epoch seconds, to count the runs in flight at any moment.
SELECT extract(epoch FROM started_at)::float8 AS started, extract(epoch FROM finished_at)::float8 AS finished
FROM runs

-- name: model_bound_not_messaged
-- Runs that did not end with their message (a failed call, a script gap): the workload is void if any.
SELECT count(*)::int AS n FROM runs WHERE outcome <> 'message'
