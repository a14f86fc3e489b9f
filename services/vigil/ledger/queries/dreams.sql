-- Dreaming (docs/agent.md, "Dreaming"): the scheduler's memory reviews and the memory
-- history that audits every change of a memory file. Writers: the scheduler (review_schedule),
-- an operator's `vigil memory revert` (memory_revert_*). The memory tool's own writes and
-- their history rows are finish.sql's upsert_memory and delete_memory.

-- name: review_schedule
-- A memory review queued for every user with at least %(after)s sessions created since their last review (any status; never: since ever). The unique index tasks_one_open_review keeps one open per user: two schedulers racing insert one, the other's row conflicts and is dropped.
WITH last AS (
    SELECT user_id, max(created_at) AS at FROM tasks WHERE kind = 'memory_review' GROUP BY user_id
), due AS (
    SELECT s.user_id, count(*) AS sessions
    FROM sessions s LEFT JOIN last ON last.user_id = s.user_id
    WHERE s.created_at > coalesce(last.at, '-infinity'::timestamptz)
    GROUP BY s.user_id
    HAVING count(*) >= %(after)s
)
INSERT INTO tasks (id, kind, user_id, parent_run_key, depth, owner_chain, instructions, tools, token_budget,
                   max_attempts, deadline)
SELECT 'tsk_' || substr(md5(due.user_id || clock_timestamp()::text || random()::text), 1, 20), 'memory_review',
       due.user_id, 'scheduler:dream', 1, ARRAY[due.user_id],
       format('Review this person''s memory: %%s new conversations since the last review.', due.sessions),
       '{}', %(token_budget)s, %(max_attempts)s,
       coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(timeout_s)s)
FROM due
ORDER BY due.user_id
ON CONFLICT (user_id) WHERE kind = 'memory_review' AND status IN ('queued', 'running') DO NOTHING
RETURNING id, user_id

-- name: memory_history_of_user
-- A user's memory changes, newest first, keyset-paged by id.
SELECT * FROM memory_history
WHERE user_id = %(user_id)s AND (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s

-- name: memory_history_get
-- One change.
SELECT * FROM memory_history WHERE id = %(id)s

-- name: memory_revert_recreate
-- Undo a delete: the file comes back only if nobody created it since (else no row), audited in the same statement.
WITH done AS (
    INSERT INTO memory (user_id, path, content) VALUES (%(user_id)s, %(path)s, %(content)s)
    ON CONFLICT (user_id, path) DO NOTHING
    RETURNING user_id
)
INSERT INTO memory_history (user_id, path, old_content, new_content, actor, reverts)
SELECT %(user_id)s, %(path)s, NULL, %(content)s, %(actor)s, %(reverts)s FROM done
RETURNING *

-- name: memory_revert_rewrite
-- Undo an edit: the old content back only if the file still holds what the change wrote (else no row), audited in the same statement.
WITH done AS (
    UPDATE memory SET content = %(content)s, run_id = NULL, updated_at = now()
    WHERE user_id = %(user_id)s AND path = %(path)s AND content = %(expected)s
    RETURNING user_id
)
INSERT INTO memory_history (user_id, path, old_content, new_content, actor, reverts)
SELECT %(user_id)s, %(path)s, %(expected)s, %(content)s, %(actor)s, %(reverts)s FROM done
RETURNING *

-- name: memory_revert_remove
-- Undo a create: the file goes only if it still holds what the change wrote (else no row), audited in the same statement.
WITH done AS (
    DELETE FROM memory WHERE user_id = %(user_id)s AND path = %(path)s AND content = %(expected)s
    RETURNING user_id
)
INSERT INTO memory_history (user_id, path, old_content, new_content, actor, reverts)
SELECT %(user_id)s, %(path)s, %(expected)s, NULL, %(actor)s, %(reverts)s FROM done
RETURNING *
