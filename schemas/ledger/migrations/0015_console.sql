-- 0015: indexes for the operator console's bounded reads.
--
-- Approvals still waiting, nearest deadline first: without this index that list reads every
-- approval ever asked. Approvals are written once per deferred tool call, far off the hot path.
CREATE INDEX approvals_open_by_due ON approvals (due, request_id) WHERE answer IS NULL;
-- Runs finished in the last minutes (the overview's runs/s): a range scan instead of a walk
-- over the newest runs. runs is insert-only and finished_at grows with it, so each run adds
-- one entry at the index's right edge; retention's prune (finished_at < cutoff) can use it too.
CREATE INDEX runs_by_finish ON runs (finished_at);
