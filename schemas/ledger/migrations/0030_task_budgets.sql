-- 0030: what a run's background tasks spent, on the run that delegated them (docs/tasks.md,
-- "Budgets"). The holder's terminal write adds its task's usage here in the same statement,
-- so the runs row says what the run and its children cost, and a user's totals over their
-- runs include their tasks.
ALTER TABLE runs
    ADD COLUMN task_turns         integer NOT NULL DEFAULT 0,
    ADD COLUMN task_input_tokens  integer NOT NULL DEFAULT 0,
    ADD COLUMN task_output_tokens integer NOT NULL DEFAULT 0;
