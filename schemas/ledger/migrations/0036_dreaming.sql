-- 0036: dreaming (docs/agent.md, "Dreaming"). A memory review is a background task of kind
-- memory_review that the scheduler queues for a user after VIGIL_DREAM_AFTER_SESSIONS new
-- sessions; at most one is open per user (the unique index below: two schedulers racing
-- insert one). memory_history keeps every change of a memory file (by a run's finish, a
-- review, or an operator's revert) with the old and new content, so any change can be undone.
ALTER TABLE tasks
    ADD COLUMN kind text NOT NULL DEFAULT 'delegated',
    ADD CONSTRAINT tasks_kind_valid CHECK (kind IN ('delegated', 'memory_review'));
CREATE UNIQUE INDEX tasks_one_open_review ON tasks (user_id)
    WHERE kind = 'memory_review' AND status IN ('queued', 'running');
CREATE INDEX tasks_reviews ON tasks (user_id, created_at) WHERE kind = 'memory_review';

CREATE TABLE memory_history (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id      text        NOT NULL,
    path         text        NOT NULL,
    old_content  text,                                     -- NULL: the file did not exist
    new_content  text,                                     -- NULL: the file was deleted
    run_id       bigint,                                   -- the run whose finish wrote it
    task_id      text,                                     -- the background task (a memory review) that wrote it
    actor        text,                                     -- the operator of a revert
    reverts      bigint,                                   -- the change a revert undid
    at           timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT memory_history_changed CHECK (old_content IS DISTINCT FROM new_content)
);
CREATE INDEX memory_history_by_user ON memory_history (user_id, id);
