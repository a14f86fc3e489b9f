-- Moving a partition's users from one shard to another (`vigil shards move`). Read
-- services/vigil/ledger/shardmove.py for the order of the steps and what an interruption leaves.
-- {table} is one of shardmove.py's fixed table names (psycopg.sql.Identifier), never input.

-- name: move_row
-- The catalog's record of the partition's move (none: never moved).
SELECT partition, source, target, state FROM shard_moves WHERE partition = %(partition)s

-- name: move_begin
-- A new move of the partition, unless one is in progress (zero rows: it is; the caller reads it). A finished move's row is started again.
INSERT INTO shard_moves AS m (partition, source, target)
VALUES (%(partition)s, %(source)s, %(target)s)
ON CONFLICT (partition) DO UPDATE
SET source = EXCLUDED.source, target = EXCLUDED.target, state = 'copying', started_at = now(),
    flipped_at = NULL, finished_at = NULL
WHERE m.state = 'done'
RETURNING partition

-- name: move_flip
-- Copied and verified: the map's row names the target, in the statement that records it (zero rows: the move is not copying to this target any more).
WITH moved AS (
    UPDATE shard_moves SET state = 'flipped', flipped_at = now()
    WHERE partition = %(partition)s AND state = 'copying' AND target = %(target)s
    RETURNING partition, target
)
INSERT INTO shard_map AS s (partition, shard)
SELECT partition, target FROM moved
ON CONFLICT (partition) DO UPDATE SET shard = EXCLUDED.shard, assigned_at = now()
RETURNING s.shard

-- name: move_done
-- The source's rows are deleted: the move is over.
UPDATE shard_moves SET state = 'done', finished_at = now() WHERE partition = %(partition)s AND state = 'flipped'

-- name: move_fence_row
-- The partition's fencing row on the source: whether the move still holds it.
SELECT epoch, holder FROM partitions WHERE topic = %(topic)s AND partition = %(partition)s

-- name: move_fence_copy
-- The fencing row on the target: at least the source's epoch, so an owner's takeover there starts past every epoch used on the source.
INSERT INTO partitions AS p (topic, partition, epoch, holder, acquired_at)
VALUES (%(topic)s, %(partition)s, %(epoch)s, %(holder)s, now())
ON CONFLICT (topic, partition) DO UPDATE
SET epoch = greatest(p.epoch, EXCLUDED.epoch), holder = EXCLUDED.holder, acquired_at = now(), handover_until = NULL

-- name: move_user_ids
-- Every user with a row in a per-user table of this shard (one read of each table's user ids; the caller keeps those of the partition).
SELECT user_id FROM users
UNION SELECT user_id FROM event_keys UNION SELECT user_id FROM events UNION SELECT user_id FROM runs
UNION SELECT user_id FROM run_journal UNION SELECT user_id FROM outbox UNION SELECT user_id FROM timers
UNION SELECT user_id FROM sessions UNION SELECT user_id FROM memory UNION SELECT user_id FROM memory_history
UNION SELECT user_id FROM tasks UNION SELECT user_id FROM approvals UNION SELECT user_id FROM budget_notices
UNION SELECT user_id FROM refunds

-- name: move_out_users
-- A chunk of users' rows of {table}, as they are (binary COPY; every column, ids included).
COPY (SELECT * FROM {table} WHERE user_id = ANY(%(users)s::text[])) TO STDOUT (FORMAT BINARY)

-- name: move_out_partition
-- The partition's row of {table} (consumer_positions).
COPY (SELECT * FROM {table} WHERE topic = %(topic)s AND partition = %(partition)s) TO STDOUT (FORMAT BINARY)

-- name: move_stage
-- The target's staging table for one chunk, dropped at its commit.
CREATE TEMP TABLE move_stage (LIKE {table}) ON COMMIT DROP

-- name: move_in
-- The chunk into the staging table.
COPY move_stage FROM STDIN (FORMAT BINARY)

-- name: move_id_collisions
-- Staged rows whose id the target already gives another user's row: the two shards' identity sequences overlapped.
SELECT count(*)::int AS n FROM move_stage s JOIN {table} t ON t.id = s.id WHERE t.user_id <> s.user_id

-- name: move_columns
-- The columns of a table that a copy writes: every one but the generated (run_journal.lead_event, computed again on the target).
SELECT attname FROM pg_attribute
WHERE attrelid = %(table)s::regclass AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
ORDER BY attnum

-- name: move_insert
-- The staged chunk into {table} ({columns}: move_columns); a row copied before (an interrupted run) is left as it is. Ids as they were (OVERRIDING SYSTEM VALUE).
INSERT INTO {table} ({columns}) OVERRIDING SYSTEM VALUE SELECT {columns} FROM move_stage ON CONFLICT DO NOTHING

-- name: move_tally_users
-- How many rows of {table} these users have, and a sum of their rows' hashes: equal on both shards means the same rows.
SELECT count(*)::bigint AS n, coalesce(sum(hashtextextended(t::text, 0)), 0)::numeric AS hash
FROM {table} t WHERE user_id = ANY(%(users)s::text[])

-- name: move_tally_partition
-- move_tally_users for the partition's row of {table} (consumer_positions).
SELECT count(*)::bigint AS n, coalesce(sum(hashtextextended(t::text, 0)), 0)::numeric AS hash
FROM {table} t WHERE topic = %(topic)s AND partition = %(partition)s

-- name: move_delete_users
-- A chunk of users' rows of {table}: on the source after the flip, or on the target before a table is copied again.
DELETE FROM {table} WHERE user_id = ANY(%(users)s::text[])

-- name: move_delete_partition
-- move_delete_users for the partition's row of {table} (consumer_positions).
DELETE FROM {table} WHERE topic = %(topic)s AND partition = %(partition)s

-- name: move_advance_identity
-- The target's identity sequence of {table} past its largest id (copied ids included), so its next row cannot take one.
WITH s AS (SELECT pg_get_serial_sequence(%(table)s, 'id')::regclass AS seq),
     m AS (SELECT max(id) AS top FROM {table})
SELECT setval(s.seq, m.top) AS advanced FROM s, m
WHERE m.top IS NOT NULL AND m.top > coalesce(pg_sequence_last_value(s.seq), 0)
