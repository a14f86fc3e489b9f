-- 0026: the run journal. Every step of a run (a model turn, an action tool call) is appended
-- as it happens, fenced by the claim's epoch (a background task's: its lease epoch), so a run
-- taken over after a crash, a deploy's stop or a rebalance replays what it already did instead
-- of asking the model again and calling its tools again (docs/worker.md, "Durable runs").
CREATE TABLE run_journal (
    run_key     text        NOT NULL,
    step        integer     NOT NULL,
    kind        text        NOT NULL,
    user_id     text        NOT NULL,
    epoch       bigint      NOT NULL,
    attempt     integer     NOT NULL,
    body        json        NOT NULL,
    outcome     json,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    outcome_at  timestamptz,
    finished_at timestamptz,
    PRIMARY KEY (run_key, step),
    CONSTRAINT run_journal_kind_valid CHECK (kind IN ('model', 'call')),
    CONSTRAINT run_journal_step_positive CHECK (step >= 1),
    CONSTRAINT run_journal_outcome_of_call CHECK (outcome IS NULL OR kind = 'call')
);
CREATE INDEX run_journal_live ON run_journal (user_id, run_key) WHERE finished_at IS NULL;
CREATE INDEX run_journal_finished ON run_journal (finished_at) WHERE finished_at IS NOT NULL;
