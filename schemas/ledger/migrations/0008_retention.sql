-- 0008: retention (services/vigil/ledger/retention.py) deletes finished runs in batches.
-- outbox.run_id references runs: without an index there, every deleted run made PostgreSQL
-- scan the whole outbox for rows that still point at it, and so did the prune's own check.
CREATE INDEX outbox_by_run ON outbox (run_id);
