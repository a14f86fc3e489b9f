-- 0030: what a run's background tasks spent, on the run that delegated them (docs/tasks.md,
-- "Budgets"). The holder's terminal write adds its task's usage here in the same statement,
-- so the runs row says what the run and its children cost, and a user's totals over their
-- runs include their tasks.
ALTER TABLE runs
    ADD COLUMN task_turns         integer NOT NULL DEFAULT 0,
    ADD COLUMN task_input_tokens  integer NOT NULL DEFAULT 0,
    ADD COLUMN task_output_tokens integer NOT NULL DEFAULT 0;

-- A running task's progress, flushed by its holder's heartbeat (at most every
-- VIGIL_TASK_HEARTBEAT_S) with its turns and tokens so far: the last tool the child called
-- and its latest note (the text it wrote with that call). A task ended by the reaper keeps
-- what was flushed.
ALTER TABLE tasks
    ADD COLUMN last_tool   text,
    ADD COLUMN note        text,
    ADD COLUMN progress_at timestamptz;
