-- 0019: background tasks delegated to sub-agents (services/vigil/worker/tasks.py, docs/tasks.md).
-- tasks: background work a run delegated to a sub-agent (docs/tasks.md). The row is the one
-- authority over the task's life: every change of status is one statement that checks the
-- status (and, while running, the lease epoch) it expects, so the first terminal outcome
-- stands and a late write from a previous holder matches nothing.
--   status: queued    -> running (a worker's claim: lease_epoch + 1, attempt counted)
--                     -> cancelled (owner's cancel) | timed_out (reaper: deadline passed)
--           running   -> succeeded | failed | cancelled (its holder, compare-and-set on lease_epoch)
--                     -> queued (reaper: heartbeat too old, attempts left) | lost (none left)
--                     -> timed_out (reaper: deadline passed)
--           succeeded, failed, cancelled, timed_out, lost: terminal (finished_at set);
--           the worker then reports it once as an event `task:<id>` (reported_at set)
CREATE TABLE tasks (
    id                  text        PRIMARY KEY,             -- tsk_<random>, chosen by the delegating run
    user_id             text        NOT NULL,                -- the user whose agent delegated it
    parent_run_key      text        NOT NULL,                -- run key of the delegating run (or parent task id)
    parent_task_id      text,                                -- set when a task delegated it
    session_id          text,                                -- the session its result resumes
    depth               integer     NOT NULL,                -- 1: delegated by a run; 2: by such a task; ...
    owner_chain         text[]      NOT NULL,                -- user id, then the delegating run key and task ids
    instructions        text        NOT NULL,
    tools               text[]      NOT NULL DEFAULT '{}',   -- the child's tools: a subset of the parent's allowed ones
    token_budget        integer     NOT NULL,                -- most input+output tokens the child may use
    status              text        NOT NULL DEFAULT 'queued',
    attempts            integer     NOT NULL DEFAULT 0,      -- counted at claim
    max_attempts        integer     NOT NULL,
    lease_holder        text,                                -- worker instance executing it
    lease_epoch         bigint      NOT NULL DEFAULT 0,      -- grows at every claim: fences earlier holders
    heartbeat_at        timestamptz,                         -- the holder's latest proof of life
    deadline            timestamptz NOT NULL,                -- timed_out past this, whatever its state
    cancel_requested_at timestamptz,
    cancel_requested_by text,
    created_at          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz,
    finished_at         timestamptz,                         -- set exactly when terminal
    result              text,                                -- the child's final answer
    error               text,                                -- why it failed, was lost, timed out or cancelled
    turns               integer     NOT NULL DEFAULT 0,      -- usage, counted against the parent's budgets
    input_tokens        integer     NOT NULL DEFAULT 0,
    output_tokens       integer     NOT NULL DEFAULT 0,
    reported_at         timestamptz,                         -- its result event was acknowledged by the broker
    CONSTRAINT tasks_status_valid
        CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'timed_out', 'lost')),
    CONSTRAINT tasks_finished_iff_terminal
        CHECK ((status IN ('succeeded', 'failed', 'cancelled', 'timed_out', 'lost')) = (finished_at IS NOT NULL)),
    CONSTRAINT tasks_running_has_lease CHECK (status <> 'running' OR (lease_holder IS NOT NULL AND heartbeat_at IS NOT NULL)),
    CONSTRAINT tasks_depth_positive CHECK (depth >= 1),
    CONSTRAINT tasks_reported_after_finish CHECK (reported_at IS NULL OR finished_at IS NOT NULL)
);
-- The claim takes the oldest queued tasks; the reaper reads running ones by heartbeat age.
CREATE INDEX tasks_queued ON tasks (created_at) WHERE status = 'queued';
CREATE INDEX tasks_running ON tasks (heartbeat_at) WHERE status = 'running';
-- Terminal tasks whose result event has not been produced yet (a handful at any time).
CREATE INDEX tasks_unreported ON tasks (finished_at) WHERE finished_at IS NOT NULL AND reported_at IS NULL;
CREATE INDEX tasks_by_user ON tasks (user_id, created_at);
