-- Daily token budgets (docs/agent.md, "Budgets"): what a user's runs spent today, billed as the
-- provider bills them, and the one notice per user and day that the budget is spent.

-- name: budgets_spent
-- Billed tokens of the user's runs since `since`, their ended background tasks' too, through runs_by_user (the cache weights are vigil.ledger.budgets' billed(), which a run's token cap uses); plus the whole token budget of each background task of theirs still open (queued or running), through tasks_by_user: held until it ends and its usage joins its run's row, so a run that starts while tasks of the user work cannot spend what they may.
SELECT ceil(coalesce(sum(input_tokens + output_tokens + %(write_weight)s * cache_write_tokens
                         + %(read_weight)s * cache_read_tokens + task_input_tokens + task_output_tokens), 0))::bigint
       + (SELECT coalesce(sum(t.token_budget), 0) FROM tasks t
          WHERE t.user_id = %(user_id)s AND t.created_at >= %(since)s AND t.status IN ('queued', 'running')
            AND t.mode = 'background')::bigint
       AS spent
FROM runs WHERE user_id = %(user_id)s AND started_at >= %(since)s

-- name: budgets_notify_once
-- The user's notice for this day, with its outbox row; nothing when it was sent already.
WITH first AS (
    INSERT INTO budget_notices (user_id, day, profile) VALUES (%(user_id)s, %(day)s, %(profile)s)
    ON CONFLICT (user_id, day) DO NOTHING
    RETURNING user_id
)
INSERT INTO outbox (user_id, run_id, epoch, body, urgent)
SELECT user_id, 0, 0, %(body)s, false FROM first
RETURNING id

-- name: budgets_release
-- The events waiting for their user's daily budget (pending, the error starting with %(prefix)s, not yet due) of the users whose profile is %(profile)s (their most specific assignment: the exact id, else the longest prefix) are due now: the profile's budget was changed. The notices of those users still queued (run 0 marks a notice's outbox row; pending with no delivery id fixed: no send began) are withdrawn, with their latest budget_notices row, so a user still past the new budget is refused again with no attempt counted and told once, by the refusal's notice.
WITH waiting AS (
    SELECT DISTINCT user_id FROM events
    WHERE status = 'pending' AND starts_with(error, %(prefix)s) AND next_attempt_at > coalesce(%(now)s::timestamptz, now())
),
owned AS (
    SELECT w.user_id FROM waiting w
    WHERE (SELECT a.profile FROM profile_assignments a
           WHERE a.pattern = w.user_id OR (right(a.pattern, 1) = '*' AND starts_with(w.user_id, left(a.pattern, -1)))
           ORDER BY a.pattern = w.user_id DESC, length(a.pattern) DESC LIMIT 1) = %(profile)s
),
released AS (
    UPDATE events e SET next_attempt_at = coalesce(%(now)s::timestamptz, now())
    FROM owned
    WHERE e.user_id = owned.user_id AND e.status = 'pending' AND starts_with(e.error, %(prefix)s)
      AND e.next_attempt_at > coalesce(%(now)s::timestamptz, now())
    RETURNING e.user_id
),
-- A row the dispatcher is claiming is locked: this waits, then sees it 'sending' and keeps it.
withdrawn AS (
    DELETE FROM outbox o
    WHERE o.user_id IN (SELECT user_id FROM released) AND o.run_id = 0
      AND o.status = 'pending' AND o.delivery_id IS NULL
    RETURNING o.user_id
),
forgotten AS (
    DELETE FROM budget_notices n
    USING (SELECT user_id, max(day) AS day FROM budget_notices
           WHERE user_id IN (SELECT user_id FROM withdrawn) GROUP BY user_id) latest
    WHERE n.user_id = latest.user_id AND n.day = latest.day
)
SELECT (SELECT count(*) FROM released) AS released, (SELECT count(*) FROM withdrawn) AS withdrawn
