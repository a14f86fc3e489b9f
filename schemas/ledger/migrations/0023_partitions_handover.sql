-- 0023: a revoked partition's hand-over deadline.
--
-- A worker whose partition is revoked while runs of it are in flight used to wait for them
-- inside the consumer's revoke callback (VIGIL_REVOKE_GRACE_S), recording nothing for any of
-- its partitions meanwhile. Now it leaves a deadline on the partition's row and returns at
-- once: its runs keep finishing under the epoch that is still its own, and the next owner's
-- takeover waits until the deadline passes or the revoking worker clears it (its last run of
-- the partition gone). NULL: no hand-over in progress. A takeover clears it.
ALTER TABLE partitions ADD COLUMN handover_until timestamptz;
