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

-- name: rebalance_handing
-- Partitions a revoking worker is handing over now (fencing rule 4).
SELECT count(*)::int AS n FROM partitions WHERE handover_until IS NOT NULL

-- name: rebalance_moved_record_s
-- Seconds from produce to the ledger for the events of %(source)s whose user's home partition
-- moved to the second worker (taken over again: epoch 2 or later).
SELECT extract(epoch FROM e.recorded_at - e.received_at)::float8 AS s
FROM events e
JOIN users u ON u.user_id = e.user_id
JOIN partitions p ON p.topic = u.home_topic AND p.partition = u.home_partition
WHERE e.source = %(source)s AND p.epoch >= 2

-- name: model_bound_journal_mark
-- Where the journal's counters stand: rows appended so far and the WAL position.
SELECT coalesce((SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'run_journal'), 0)::bigint AS rows,
       pg_current_wal_lsn()::text AS lsn

-- name: model_bound_journal_walinspect
-- pg_walinspect (PostgreSQL's contrib) reads the WAL records back; needs a superuser, as the bench's server has.
CREATE EXTENSION IF NOT EXISTS pg_walinspect

-- name: model_bound_journal_wal
-- WAL bytes of the records that touch the journal's table or its indexes (appends, and the finishes' deletes) between two positions.
WITH rels AS (
    SELECT pg_relation_filenode(c.oid)::text AS node FROM pg_class c
    WHERE c.oid = 'run_journal'::regclass
       OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'run_journal'::regclass)
)
SELECT coalesce(sum(w.record_length), 0)::bigint AS bytes
FROM pg_get_wal_records_info(%(since)s::pg_lsn, %(until)s::pg_lsn) w
WHERE EXISTS (SELECT 1 FROM rels r WHERE w.block_ref ~ ('rel [0-9]+/[0-9]+/' || r.node || '([^0-9]|$)'))
