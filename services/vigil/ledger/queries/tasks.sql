-- Background tasks (docs/tasks.md): the task row is the one authority over a task's life.
-- Writers: the delegating run's fenced finish (task_create), any worker (task_claim,
-- task_heartbeat, task_finish, the reaper's task_reap_*, the reporter's task_mark_reported),
-- the owner through ingest or `vigil tasks cancel` (task_cancel). Every status change is one
-- statement that checks the status it expects; the holder's also check its lease epoch.
-- Clocks (docs/tasks.md, "One clock"): deadlines are decided on the caller's clock,
-- coalesce(%(now)s, now()); every stamp of the row (started, heartbeat, progress, cancel,
-- finished, reported) and the lease (a heartbeat's age) on the ledger's, clock_timestamp()
-- (the time of the write, after any lock it waited for, not the transaction's start), and a
-- later stamp never below an earlier one: greatest(..., heartbeat_at).

-- name: task_open_lock
-- A user's lock on opening tasks (VIGIL_MAX_OPEN_TASKS_PER_USER), held to the end of the finish's transaction; its own statement, so that task_create's count is read after it is held.
SELECT pg_advisory_xact_lock(hashtextextended('vigil.tasks.open:' || %(user_id)s, 0))

-- name: task_open_count
-- The user's open background tasks (queued or running): sync children are bounded by their run, not by this.
SELECT count(*) AS open FROM tasks WHERE user_id = %(user_id)s AND status IN ('queued', 'running') AND mode = 'background'

-- name: task_create
-- A task delegated by a run, inserted in that run's fenced finish (a run that does not commit starts nothing). Past %(max_open)s open tasks of its user (NULL: no bound) it is inserted already failed, with the reason: its result event tells the agent.
INSERT INTO tasks (id, user_id, parent_run_key, parent_task_id, session_id, depth, owner_chain, instructions,
                   tools, token_budget, max_attempts, deadline, run_id, profile, profile_version,
                   status, finished_at, error)
SELECT %(id)s, %(user_id)s, %(parent_run_key)s, %(parent_task_id)s, %(session_id)s, %(depth)s, %(owner_chain)s,
       %(instructions)s, %(tools)s, %(token_budget)s, %(max_attempts)s,
       coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(timeout_s)s),
       %(run_id)s, %(profile)s, %(profile_version)s,
       CASE WHEN full_up THEN 'failed' ELSE 'queued' END,
       CASE WHEN full_up THEN now() END,
       CASE WHEN full_up THEN format('not started: this user already has at most %%s open background tasks (VIGIL_MAX_OPEN_TASKS_PER_USER)', %(max_open)s::int) END
FROM (SELECT %(max_open)s::int IS NOT NULL AND count(*) >= %(max_open)s::int AS full_up
      FROM tasks WHERE user_id = %(user_id)s AND status IN ('queued', 'running') AND mode = 'background') AS bound
ON CONFLICT (id) DO NOTHING

-- name: task_sync_started
-- A sync child starting inside its run (best effort; docs/tasks.md "Every child visible"): running, no lease, deadline its run's (the caller's clock), started on the ledger's. Its id is derived from the delegate call's step key, so a replayed run starts the same row again (an attempt counted), never a second one; a background task's row is never touched.
INSERT INTO tasks AS t (id, user_id, parent_run_key, parent_task_id, session_id, depth, owner_chain, instructions,
                        tools, token_budget, max_attempts, deadline, run_id, mode, status, attempts, started_at)
VALUES (%(id)s, %(user_id)s, %(parent_run_key)s, %(parent_task_id)s, %(session_id)s, %(depth)s, %(owner_chain)s,
        %(instructions)s, %(tools)s, %(token_budget)s, %(max_attempts)s,
        coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(timeout_s)s), %(run_id)s, 'sync', 'running', 1,
        clock_timestamp())
ON CONFLICT (id) DO UPDATE
SET status = 'running',
    attempts = t.attempts + 1,
    deadline = excluded.deadline,
    started_at = excluded.started_at,
    finished_at = NULL,
    reported_at = NULL,
    result = NULL,
    error = NULL
WHERE t.mode = 'sync'

-- name: task_sync_ended
-- A sync child's end, written by its run: its status, answer or error and usage (its own sync children's included). Already reported (its answer went back as the tool result; no event wakes anyone). The last word of its run stands, whatever the reaper said meanwhile.
UPDATE tasks
SET status = %(status)s,
    finished_at = greatest(stamp.at, started_at),
    reported_at = greatest(stamp.at, started_at),
    result = %(result)s,
    error = %(error)s,
    turns = %(turns)s,
    input_tokens = %(input_tokens)s,
    output_tokens = %(output_tokens)s,
    last_tool = %(last_tool)s,
    note = %(note)s,
    progress_at = greatest(stamp.at, started_at)
FROM (SELECT clock_timestamp() AS at) AS stamp
WHERE id = %(id)s AND mode = 'sync'
RETURNING id

-- name: task_claim
-- The oldest queued tasks still within their deadline (the caller's clock) and not asked to stop, taken by one worker: a new lease epoch, an attempt counted, a first heartbeat (the ledger's clock, as every heartbeat). SKIP LOCKED: two workers never wait for each other or take the same task.
WITH picked AS (
    SELECT id FROM tasks
    WHERE status = 'queued' AND mode = 'background' AND deadline > coalesce(%(now)s::timestamptz, now())
      AND cancel_requested_at IS NULL
    ORDER BY created_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE tasks t
SET status = 'running',
    attempts = t.attempts + 1,
    lease_holder = %(holder)s,
    lease_epoch = t.lease_epoch + 1,
    heartbeat_at = stamp.at,
    started_at = coalesce(t.started_at, stamp.at)
FROM picked, (SELECT clock_timestamp() AS at) AS stamp
WHERE t.id = picked.id AND t.status = 'queued'
RETURNING t.*

-- name: task_heartbeat
-- The holder's proof of life, stamped on the ledger's clock as it is received (the holder's own clock never enters the lease), carrying the task's progress so far (usage, last tool, note). No row: the lease is gone (reaped, timed out, or taken by another worker), so stop and write nothing. cancel: the owner asked to stop.
UPDATE tasks
SET heartbeat_at = stamp.at,
    turns = %(turns)s,
    input_tokens = %(input_tokens)s,
    output_tokens = %(output_tokens)s,
    last_tool = %(last_tool)s,
    note = %(note)s,
    progress_at = stamp.at
FROM (SELECT clock_timestamp() AS at) AS stamp
WHERE id = %(id)s AND status = 'running' AND lease_epoch = %(lease_epoch)s
RETURNING cancel_requested_at IS NOT NULL AS cancel

-- name: task_finish
-- A terminal outcome from the task's holder: compare-and-set on status and lease epoch, so the first terminal outcome stands and a previous holder's late result matches nothing. The task's usage is added to the delegating run's row in the same statement (once: only the write that stands adds it).
WITH done AS (
    UPDATE tasks
    SET status = %(status)s,
        finished_at = greatest(clock_timestamp(), heartbeat_at),
        result = %(result)s,
        error = %(error)s,
        turns = %(turns)s,
        input_tokens = %(input_tokens)s,
        output_tokens = %(output_tokens)s,
        lease_holder = NULL
    WHERE id = %(id)s AND status = 'running' AND lease_epoch = %(lease_epoch)s
    RETURNING id, run_id, turns, input_tokens, output_tokens
), rolled AS (
    UPDATE runs r
    SET task_turns = r.task_turns + done.turns,
        task_input_tokens = r.task_input_tokens + done.input_tokens,
        task_output_tokens = r.task_output_tokens + done.output_tokens
    FROM done
    WHERE r.id = done.run_id
)
SELECT id FROM done

-- name: task_reap_timed_out
-- Tasks past their deadline, queued or running: timed_out. A holder still running one finds its lease gone at its next heartbeat.
UPDATE tasks
SET status = 'timed_out',
    finished_at = greatest(clock_timestamp(), heartbeat_at),
    lease_holder = NULL,
    error = format('deadline passed (%%s) after %%s attempt(s)', to_char(deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), attempts)
WHERE status IN ('queued', 'running') AND mode = 'background' AND deadline <= coalesce(%(now)s::timestamptz, now())
RETURNING id, user_id

-- name: task_reap_sync
-- Sync rows still running past their deadline (their run's): the run died or was stopped without writing the child's end, and no replay wrote it since. Lost, already reported (no event: its parent's run never waited for one). A later replay of the run starts the row again.
UPDATE tasks
SET status = 'lost',
    finished_at = greatest(stamp.at, started_at),
    reported_at = greatest(stamp.at, started_at),
    error = 'its run ended without recording how this sync child ended (the worker died or stopped it)'
FROM (SELECT clock_timestamp() AS at) AS stamp
WHERE status = 'running' AND mode = 'sync' AND deadline <= coalesce(%(now)s::timestamptz, now())
RETURNING id, user_id

-- name: task_reap_stale
-- Running tasks whose heartbeat is older than the bound on the ledger's clock, the one that stamped it (no host's skew enters the lease): their holder is presumed gone (the heartbeat's age is the proof). A task whose cancel was requested ends cancelled (the usage its holder flushed kept); else back to queued if attempts are left, else lost with the reason. The next claim's new lease epoch fences the old holder either way.
UPDATE tasks
SET status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                  WHEN attempts >= max_attempts THEN 'lost' ELSE 'queued' END,
    finished_at = CASE WHEN cancel_requested_at IS NOT NULL OR attempts >= max_attempts
                       THEN greatest(stamp.at, heartbeat_at) END,
    error = CASE WHEN cancel_requested_at IS NOT NULL
                 THEN format('cancelled by %%s; its holder %%s fell silent before it stopped', cancel_requested_by,
                             lease_holder)
                 ELSE format('no heartbeat from %%s for %%s s (attempt %%s of %%s)', lease_holder,
                             floor(extract(epoch FROM stamp.at - heartbeat_at))::bigint, attempts, max_attempts) END,
    lease_holder = NULL
FROM (SELECT clock_timestamp() AS at) AS stamp
WHERE status = 'running' AND mode = 'background'
  AND heartbeat_at < stamp.at - make_interval(secs => %(stale_s)s)
RETURNING id, user_id, status

-- name: task_cancel
-- The owner's cancel: a queued task is cancelled at once; a running one is flagged and its holder stops it at its next heartbeat. No row: the task is already terminal (or unknown), or a sync child (it ends with its run).
UPDATE tasks
SET cancel_requested_at = coalesce(cancel_requested_at, stamp.at),
    cancel_requested_by = coalesce(cancel_requested_by, %(actor)s),
    status = CASE WHEN status = 'queued' THEN 'cancelled' ELSE status END,
    finished_at = CASE WHEN status = 'queued' THEN greatest(stamp.at, heartbeat_at) ELSE finished_at END,
    error = CASE WHEN status = 'queued' THEN format('cancelled by %%s before it started', %(actor)s::text) ELSE error END
FROM (SELECT clock_timestamp() AS at) AS stamp
WHERE id = %(id)s AND status IN ('queued', 'running') AND mode = 'background'
RETURNING *

-- name: task_unreported
-- Terminal tasks whose result event is not yet acknowledged, oldest first, locked so that one worker reports each.
SELECT * FROM tasks
WHERE finished_at IS NOT NULL AND reported_at IS NULL AND mode = 'background'
ORDER BY finished_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: task_mark_reported
-- After the broker acknowledged their result events: this statement's time, not now() (the reporter's transaction began before it read the rows, perhaps before they finished), and never before finished_at.
UPDATE tasks SET reported_at = greatest(statement_timestamp(), finished_at)
WHERE id = ANY(%(ids)s) AND reported_at IS NULL

-- name: task_get
-- One task as stored.
SELECT * FROM tasks WHERE id = %(id)s

-- name: tasks_of_user
-- A user's tasks, newest first, keyset-paged by (created_at, id).
SELECT * FROM tasks
WHERE user_id = %(user_id)s
  AND (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(before)s::timestamptz IS NULL OR created_at < %(before)s)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s

-- name: tasks_recent
-- Every user's tasks, newest first (operators), optionally of one status.
SELECT * FROM tasks
WHERE (%(status)s::text IS NULL OR status = %(status)s)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s

-- name: task_gauges
-- Background tasks by live status and the oldest heartbeat among running ones, its age on the ledger's clock as the reaper judges it (ledger-wide: use max() across workers).
SELECT count(*) FILTER (WHERE status = 'queued') AS queued,
       count(*) FILTER (WHERE status = 'running') AS running,
       coalesce(extract(epoch FROM clock_timestamp() - min(heartbeat_at) FILTER (WHERE status = 'running')), 0)::float8
           AS heartbeat_age
FROM tasks
WHERE status IN ('queued', 'running') AND mode = 'background'

-- name: task_release
-- A holder shutting down hands its task back: queued again with its attempt given back (it was not the task's fault), under the same compare-and-set as an outcome; a task whose cancel was requested ends cancelled instead.
UPDATE tasks
SET status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'queued' END,
    finished_at = CASE WHEN cancel_requested_at IS NOT NULL THEN greatest(clock_timestamp(), heartbeat_at) END,
    error = CASE WHEN cancel_requested_at IS NOT NULL
                 THEN format('cancelled by %%s; its holder %%s was shutting down', cancel_requested_by, lease_holder)
                 ELSE error END,
    attempts = CASE WHEN cancel_requested_at IS NOT NULL THEN attempts ELSE greatest(attempts - 1, 0) END,
    lease_holder = NULL
WHERE id = %(id)s AND status = 'running' AND lease_epoch = %(lease_epoch)s
RETURNING id

-- name: tasks_of_owner
-- The tasks a caller may see (docs/tasks.md, "Ownership"; ledger.tasks.may_own is the same rule): its user's, with one of the caller's owner ids (the user, over HTTP or the CLI; a run's conversation and run key, for its agent tools) in their owner chain; one of them when %(id)s is given. Never the session_id column.
SELECT * FROM tasks
WHERE user_id = %(user_id)s
  AND owner_chain && %(owners)s::text[]
  AND (%(id)s::text IS NULL OR id = %(id)s)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s

-- name: task_children
-- A task's descendants (its children, theirs, ...: depth is bounded by VIGIL_MAX_DELEGATION_DEPTH), by parent_task_id, oldest first; at most %(limit)s.
WITH RECURSIVE tree AS (
    SELECT * FROM tasks WHERE parent_task_id = %(id)s
    UNION ALL
    SELECT c.* FROM tasks c JOIN tree ON c.parent_task_id = tree.id
)
SELECT * FROM tree ORDER BY depth, created_at, id LIMIT %(limit)s
