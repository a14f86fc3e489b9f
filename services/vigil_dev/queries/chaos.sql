-- Read-only look-ups for `make chaos` (vigil_dev.chaos.checks): what the ledger holds of one run's users.

-- name: chaos_events
-- The chat events of the run's users (their user ids share a prefix).
SELECT id, user_id, source_id, status, received_at, recorded_at
FROM events WHERE user_id LIKE %(prefix)s AND source = 'chat' ORDER BY id

-- name: chaos_runs
-- Every run of the run's users, failed attempts included.
SELECT id, user_id, partition, event_ids, started_at, finished_at, outcome
FROM runs WHERE user_id LIKE %(prefix)s ORDER BY user_id, started_at

-- name: chaos_outbox
-- Every message written for the run's users, and whether it was delivered.
SELECT id, user_id, run_id, status, delivery_id, delivered_at
FROM outbox WHERE user_id LIKE %(prefix)s ORDER BY id

-- name: chaos_unsettled
-- What still moves for the run's users: events not finished, messages not delivered.
SELECT (SELECT count(*) FROM events WHERE user_id LIKE %(prefix)s AND status IN ('pending', 'running'))::int AS events,
       (SELECT count(*) FROM outbox WHERE user_id LIKE %(prefix)s AND status IN ('pending', 'sending'))::int AS messages

-- name: chaos_held
-- The events topic's partitions a worker holds in the ledger (its instance id is the holder).
SELECT partition FROM partitions WHERE holder = %(holder)s ORDER BY partition
