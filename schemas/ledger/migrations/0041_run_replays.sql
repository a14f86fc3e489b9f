-- 0041: what-if replays recorded (issue 59). `vigil runs replay` runs a kept run again against
-- a changed agent, executing nothing; each replay leaves one row here so the console's run
-- page can list a run's replays and their verdicts.
CREATE TABLE run_replays (
    id               bigserial   PRIMARY KEY,
    run_key          text        NOT NULL,
    user_id          text        NOT NULL,
    made_at          timestamptz NOT NULL DEFAULT now(),
    made_by          text        NOT NULL,
    ran_with         text        NOT NULL,
    verdict          text        NOT NULL,
    messages_changed boolean     NOT NULL,
    report           json        NOT NULL,
    CONSTRAINT run_replays_verdict_valid CHECK (verdict IN ('same actions', 'different actions', 'new actions'))
);
CREATE INDEX run_replays_of_run ON run_replays (user_id, run_key);
