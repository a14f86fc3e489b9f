-- The benchmark's own statements: the raw PostgreSQL limit and reading results back.
-- Loaded by name like the ledger's queries (vigil.ledger.queries.parse).

-- name: raw_insert_events
-- The raw limit, as a plain client writes it: events-shaped rows as arrays, one multi-row insert per batch, duplicates dropped by the ledger's key table (event_keys); no users, no RETURNING.
WITH batch AS (
    SELECT * FROM unnest(%(user_id)s::text[], %(source)s::text[], %(source_id)s::text[], %(kind)s::text[],
                         %(payload)s::text[], %(session_id)s::text[], %(headers)s::jsonb[], %(occurred_at)s::timestamptz[],
                         %(received_at)s::timestamptz[], %(topic)s::text[], %(partition)s::int[], %(offset)s::bigint[])
         AS b(user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at, kafka_topic,
              kafka_partition, kafka_offset)
),
new_keys AS (
    INSERT INTO event_keys (user_id, source, source_id) SELECT user_id, source, source_id FROM batch
    ON CONFLICT (user_id, source, source_id) DO NOTHING
    RETURNING user_id, source, source_id
)
INSERT INTO events (user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at,
                    kafka_topic, kafka_partition, kafka_offset)
SELECT b.* FROM batch b JOIN new_keys k USING (user_id, source, source_id)

-- name: raw_insert_staged
-- The raw limit fed the way the worker feeds it: the batch binary-copied into the staging table (record_staging, record_copy), then one multi-row insert, duplicates dropped by the ledger's key table (event_keys); no users, no RETURNING.
WITH new_keys AS (
    INSERT INTO event_keys (user_id, source, source_id) SELECT user_id, source, source_id FROM incoming_events
    ON CONFLICT (user_id, source, source_id) DO NOTHING
    RETURNING user_id, source, source_id
)
INSERT INTO events (user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at,
                    kafka_topic, kafka_partition, kafka_offset)
SELECT i.user_id, i.source, i.source_id, i.kind, i.payload, i.session_id, i.headers, i.occurred_at, i.received_at,
       i.kafka_topic, i.kafka_partition, i.kafka_offset
FROM incoming_events i JOIN new_keys k USING (user_id, source, source_id) ORDER BY i.n

-- name: truncate_events
-- Between raw rounds: every round inserts into an empty table.
TRUNCATE events, event_keys

-- name: foreign_home_users
-- The record workload's users live on another topic's partitions: the worker records their events but never claims them.
INSERT INTO users (user_id, home_topic, home_partition)
SELECT user_id, %(topic)s, 0 FROM unnest(%(user_ids)s::text[]) AS u(user_id)

-- name: unfinished
-- Progress of an end-to-end round: events not yet done (both partial indexes, cheap while the backlog is small).
SELECT (SELECT count(*) FROM events WHERE status = 'pending') + (SELECT count(*) FROM events WHERE status = 'running') AS n

-- name: record_round
-- A record round: how many of its events (by source) are recorded, and when the last batch was (its transaction's now()).
SELECT count(*)::int AS n, extract(epoch FROM max(recorded_at))::float8 AS last_recorded
FROM events WHERE source = %(source)s

-- name: round_totals
-- An end-to-end round's outcome: its events (by source), their runs, and when the last run finished.
SELECT count(*) FILTER (WHERE e.status = 'done') AS done,
       count(*) FILTER (WHERE e.status <> 'done') AS not_done,
       count(DISTINCT e.run_id) AS runs,
       max(r.finished_at) AS last_finished
FROM events e LEFT JOIN runs r ON r.id = e.run_id
WHERE e.source = %(source)s

-- name: round_latencies
-- Produce-to-finished latency of each event of a round, in ms: the run's finished_at (finish transaction) minus the event's received_at (stamped by the producer).
SELECT extract(epoch FROM r.finished_at - e.received_at) * 1000 AS ms
FROM events e JOIN runs r ON r.id = e.run_id
WHERE e.source = %(source)s AND e.status = 'done' AND e.received_at >= %(since)s
ORDER BY 1

-- name: round_latency_parts
-- Where a latency round's time went, median and p99 of each step in ms (and the round robin's pace): to the ledger (received_at to recorded_at: Kafka and the record transaction), to the claim (recorded_at to claimed_at, the claim transaction's start: the batch window, waiting for a pass, passes that skipped the user while its previous run was in flight), the pass (claimed_at to the run's start: the rest of the claim pass that took it) and the run with its finish (started_at to finished_at).
SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.recorded_at - e.received_at)) * 1000 AS record_p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM e.recorded_at - e.received_at)) * 1000 AS record_p99,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.claimed_at - e.recorded_at)) * 1000 AS claim_p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM e.claimed_at - e.recorded_at)) * 1000 AS claim_p99,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.started_at - e.claimed_at)) * 1000 AS pass_p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM r.started_at - e.claimed_at)) * 1000 AS pass_p99,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - r.started_at)) * 1000 AS finish_p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - r.started_at)) * 1000 AS finish_p99,
       -- The round robin's pace: runs per second, and the users over it, how often each user
       -- runs on average (with every user waiting, how long the cursor takes to come back).
       count(DISTINCT r.id) AS runs,
       count(DISTINCT e.user_id) AS users,
       greatest(extract(epoch FROM max(r.started_at) - min(r.started_at)), 0.001) AS span_s
FROM events e JOIN runs r ON r.id = e.run_id
WHERE e.source = %(source)s AND e.status = 'done' AND e.received_at >= %(since)s

-- name: finished_between
-- Events and runs finished in a stretch of an end-to-end round (only one round's events are in flight at a time).
SELECT coalesce(sum(cardinality(event_ids)), 0)::int AS events, count(*)::int AS runs
FROM runs WHERE finished_at >= %(since)s AND finished_at < %(until)s

-- name: retention_make_day
-- The partition of one past day.
SELECT ensure_event_partitions(0, ARRAY[%(day)s::date])

-- name: retention_fill_day
-- One day of finished events, with their dedup keys, in that day's partition.
WITH keys AS (
    INSERT INTO event_keys (user_id, source, source_id, recorded_at)
    SELECT 'u' || (g %% 1000), 'chat', 'old-' || g, %(day)s::date + (g %% 86400) * interval '1 second'
    FROM generate_series(1, %(n)s) AS g
    RETURNING user_id, source, source_id, recorded_at
)
INSERT INTO events (user_id, source, source_id, kind, payload, received_at, recorded_at, status, finished_at, attempts,
                    claim_epoch)
SELECT user_id, source, source_id, 'chat.message', '{"text": "an old chat message of about this size"}', recorded_at,
       recorded_at, 'done', recorded_at, 1, 1
FROM keys

-- name: count_keys
-- Dedup keys left.
SELECT count(*)::bigint AS n FROM event_keys

-- name: cost_counters
-- What the ledger database has written so far: rows (every table and partition), WAL bytes, committed transactions.
SELECT (SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables)::bigint AS rows_written,
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint AS wal_bytes,
       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database())::bigint AS transactions

-- name: cost_tables
-- The cost passes' rows by table (each partition its own): what a run writes where, printed beside the cost figures.
SELECT relname, n_tup_ins AS ins, n_tup_upd AS upd, n_tup_hot_upd AS hot, n_tup_del AS del FROM pg_stat_user_tables

-- name: cost_indexes
-- The cost passes' index scans by index: an index that its table's writes keep up but no statement scanned during the pass.
SELECT relname, indexrelname, idx_scan FROM pg_stat_user_indexes

-- name: cost_walinspect
-- The cost passes' WAL by relation: pg_walinspect (PostgreSQL's contrib) reads the records back; needs a superuser, as the bench's own server has.
CREATE EXTENSION IF NOT EXISTS pg_walinspect

-- name: cost_wal_by_relation
-- WAL bytes and records between two positions (bytes since 0/0) by the relation of each record's first block (this database's tables and indexes by name; anything else by resource manager).
WITH here AS MATERIALIZED (
    SELECT (SELECT oid FROM pg_database WHERE datname = current_database())::text AS db,
           pg_relation_filenode(c.oid)::text AS node, c.relname
    FROM pg_class c WHERE pg_relation_filenode(c.oid) IS NOT NULL
),
records AS (
    SELECT w.resource_manager, w.record_length, regexp_match(w.block_ref, 'rel [0-9]+/([0-9]+)/([0-9]+)') AS rel
    FROM pg_get_wal_records_info('0/0'::pg_lsn + %(since)s::numeric, '0/0'::pg_lsn + %(until)s::numeric) w
)
SELECT coalesce(h.relname, '(' || r.resource_manager || CASE WHEN r.rel IS NULL THEN ')' ELSE ', elsewhere)' END) AS relation,
       sum(r.record_length)::bigint AS bytes, count(*)::bigint AS records
FROM records r LEFT JOIN here h ON h.db = r.rel[1] AND h.node = r.rel[2]
GROUP BY 1 ORDER BY 2 DESC

-- name: statements_extension
-- --statements: pg_stat_statements in the bench's database (the server loads the library at start).
CREATE EXTENSION IF NOT EXISTS pg_stat_statements

-- name: statements_reset
-- --statements: forget what came before a latency round.
SELECT pg_stat_statements_reset()

-- name: statements_top
-- --statements: this database's costliest statements since the reset, by total execution time (ms; a statement waiting for a core or a lock counts its wait).
SELECT s.calls, s.total_exec_time AS total_ms, s.mean_exec_time AS mean_ms, s.rows, s.query
FROM pg_stat_statements s
WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY s.total_exec_time DESC
LIMIT %(n)s

-- name: runs_count
-- Runs finished so far (the remote_db workload's round trips per run).
SELECT count(*)::int AS n FROM runs

-- name: dispatch_fill
-- The dispatch workload's outbox: %(users)s users never delivered to, each with a Kafka channel and one message as a run's finish writes it.
WITH u AS (
    INSERT INTO users (user_id, home_topic, home_partition)
    SELECT 'd' || lpad(i::text, 7, '0'), 'events', 0 FROM generate_series(1, %(users)s) AS i
    RETURNING user_id
),
c AS (
    INSERT INTO channels (user_id, type) SELECT user_id, 'kafka' FROM u
)
INSERT INTO outbox (user_id, run_id, epoch, body)
SELECT user_id, row_number() OVER (), 1, 'Your build finished: 212 tests passed, 0 failed.' FROM u

-- name: dispatch_delivered
SELECT count(*) FROM outbox WHERE status = 'delivered'

-- name: keep_wal
-- From now until this session ends, the server keeps every WAL segment (a temporary physical replication slot, reserved at once): the WAL a workload reads back with pg_walinspect afterwards is not recycled by a checkpoint meanwhile (on a server other tests also write, one came within seconds and the read failed).
SELECT pg_create_physical_replication_slot(%(name)s, true, true)
