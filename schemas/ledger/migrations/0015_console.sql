-- 0015: the operator console lists approvals still waiting, nearest deadline first. Without
-- this index that list reads every approval ever asked; with it, only the open ones, in
-- deadline order. Approvals are written once per deferred tool call, far off the hot path.
CREATE INDEX approvals_open_by_due ON approvals (due, request_id) WHERE answer IS NULL;
