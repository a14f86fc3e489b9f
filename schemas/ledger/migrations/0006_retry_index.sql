-- 0006: an index of the pending rows that were already tried (retries, recovered claims).
-- Claim rule 2 looks for exhausted rows once per scan interval; without this index it read
-- every pending row to find them, so a backlog made every worker's periodic pass slower.
-- Fresh rows (attempts = 0) never enter it: it stays as small as the number of retries.
CREATE INDEX events_retries ON events (user_id) WHERE status = 'pending' AND attempts > 0;
