-- One fleet toward the model: the bound on concurrent model calls and the shared back-off. Read services/vigil/ledger/fleet.py for the rules.

-- name: fleet_slots_make
-- Slots 0..size-1 exist (a worker's start; idempotent, a held slot is left alone).
INSERT INTO model_slots (slot) SELECT generate_series(0, %(size)s - 1) ON CONFLICT (slot) DO NOTHING

-- name: fleet_slots_trim
-- Slots past the configured size go (the bound was lowered), once their call has ended.
DELETE FROM model_slots WHERE slot >= %(size)s AND lease_until < coalesce(%(now)s, now())

-- name: fleet_slot_take
-- A free slot (its lease over), leased for one call; none when all are held. SKIP LOCKED: two workers taking at once take different slots, neither waits.
UPDATE model_slots s SET holder = %(holder)s, lease_until = coalesce(%(now)s, now()) + make_interval(secs => %(lease_s)s)
WHERE s.slot = (
    SELECT f.slot FROM model_slots f
    WHERE f.slot < %(size)s AND f.lease_until < coalesce(%(now)s, now())
    ORDER BY f.slot LIMIT 1
    FOR UPDATE SKIP LOCKED
)
RETURNING s.slot

-- name: fleet_slot_give_back
-- The call ended: its slot is free at once (only if this holder still leases it).
UPDATE model_slots SET holder = NULL, lease_until = '-infinity' WHERE slot = %(slot)s AND holder = %(holder)s

-- name: fleet_slots_held
-- How many slots are leased now (a gauge).
SELECT count(*) AS held FROM model_slots WHERE lease_until >= coalesce(%(now)s, now())

-- name: fleet_backoff_set
-- The provider said slow down: the shared back-off moves to this instant, never back.
INSERT INTO model_backoff AS b (provider, until, reason, set_by, set_at)
VALUES (%(provider)s, %(until)s, %(reason)s, %(set_by)s, coalesce(%(now)s, now()))
ON CONFLICT (provider) DO UPDATE SET until = excluded.until, reason = excluded.reason, set_by = excluded.set_by, set_at = excluded.set_at
WHERE b.until < excluded.until

-- name: fleet_backoff_get
-- Until when the fleet waits before its next call to the provider (none: no row or in the past).
SELECT until, reason, set_by FROM model_backoff WHERE provider = %(provider)s AND until > coalesce(%(now)s, now())
