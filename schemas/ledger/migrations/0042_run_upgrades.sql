-- 0042: in-flight runs moved to a newer profile version (issue 59). `vigil runs upgrade` writes
-- one row per run it moves, with an audit row per shard; a replay of the run reads its latest
-- row and goes on under that version.
CREATE TABLE run_upgrades (
    id           bigserial   PRIMARY KEY,
    run_key      text        NOT NULL,
    user_id      text        NOT NULL,
    profile      text        NOT NULL,
    from_version integer     NOT NULL,
    to_version   integer     NOT NULL,
    made_at      timestamptz NOT NULL DEFAULT now(),
    made_by      text        NOT NULL,
    CONSTRAINT run_upgrades_newer CHECK (to_version > from_version)
);
CREATE INDEX run_upgrades_of_run ON run_upgrades (run_key, to_version);
