-- 0039: moves of partitions between ledger shards (issue 41; docs/operations.md, "Moving a
-- partition to another shard"). One row per partition ever moved, in the catalog (shard 0): a
-- move spans several shards and no transaction does, so this row is what a run of
-- `vigil shards move` reads to carry on where an interrupted one stopped.
--   state: copying -> flipped (the same command: copied, verified, shard_map changed)
--          flipped -> done    (the same command: the source's rows deleted)
--          done    terminal; the partition's next move writes the row again
CREATE TABLE shard_moves (
    partition   integer     PRIMARY KEY,
    source      integer     NOT NULL,                     -- the shard its users leave
    target      integer     NOT NULL,                     -- the shard they go to
    state       text        NOT NULL DEFAULT 'copying',
    started_at  timestamptz NOT NULL DEFAULT now(),
    flipped_at  timestamptz,                              -- shard_map changed: the target holds them
    finished_at timestamptz,                              -- the source's copies deleted
    CONSTRAINT shard_moves_state_valid CHECK (state IN ('copying', 'flipped', 'done')),
    CONSTRAINT shard_moves_two_shards CHECK (source <> target AND source >= 0 AND target >= 0),
    CONSTRAINT shard_moves_flipped_has_time CHECK ((state = 'copying') = (flipped_at IS NULL)),
    CONSTRAINT shard_moves_done_has_time CHECK ((state = 'done') = (finished_at IS NOT NULL))
);
