-- 0035: every child visible (docs/tasks.md, "Every child visible"). A sync sub-agent, run
-- inside its parent's run, gets a task row too (mode 'sync'): written best effort by that run
-- as the child starts and ends, never claimed, never reported as an event, never counted
-- against VIGIL_MAX_OPEN_TASKS_PER_USER. It holds no lease while it runs (its run's claim is
-- its lease), so the running-has-a-lease rule is for background tasks only. Children are
-- found by their parent task's id (vigil tasks show draws the tree).
ALTER TABLE tasks
    ADD COLUMN mode text NOT NULL DEFAULT 'background',
    ADD CONSTRAINT tasks_mode_valid CHECK (mode IN ('background', 'sync')),
    DROP CONSTRAINT tasks_running_has_lease,
    ADD CONSTRAINT tasks_running_has_lease
        CHECK (status <> 'running' OR mode = 'sync' OR (lease_holder IS NOT NULL AND heartbeat_at IS NOT NULL));

CREATE INDEX tasks_by_parent_task ON tasks (parent_task_id) WHERE parent_task_id IS NOT NULL;
