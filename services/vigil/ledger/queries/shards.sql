-- The shard map in the catalog and what `vigil shards` reads of each shard. Read services/vigil/ledger/shards.py.

-- name: shard_map_rows
-- Every partition's row of the map (the catalog's; empty on other shards).
SELECT partition, shard FROM shard_map ORDER BY partition

-- name: shard_map_seed
-- Rows for the partitions that have none, from the rule computed by the caller; an existing row is never rewritten.
INSERT INTO shard_map (partition, shard)
SELECT p, s FROM unnest(%(partitions)s::integer[], %(shards)s::integer[]) AS seed(p, s)
ON CONFLICT (partition) DO NOTHING

-- name: shard_schema_version
-- The newest migration recorded on this shard (NULL: none yet).
SELECT max(version) AS version FROM schema_migrations

-- name: shard_lag
-- What is waiting on this shard: events not yet done (the live queue, pending or running) and undelivered outbox rows (their partial index). Both are queues, kept small; nothing here reads history.
SELECT (SELECT count(*) FROM events_live) AS events_waiting,
       (SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')) AS outbox_pending

-- name: shard_identities_unused
-- The identity sequences of the per-user tables (%(tables)s) that have never given an id on this shard.
SELECT t AS tbl, pg_get_serial_sequence(t, 'id') AS seq
FROM unnest(%(tables)s::text[]) AS t
WHERE pg_sequence_last_value(pg_get_serial_sequence(t, 'id')::regclass) IS NULL

-- name: shard_identity_start
-- A sequence that has never given an id starts at %(start)s (its next id), this shard's range.
SELECT setval(%(seq)s::regclass, %(start)s, false)
