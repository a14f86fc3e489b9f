-- Read-only look-ups for `make chaos` (vigil_dev.chaos.checks): what the ledger holds of one run's users.

-- name: chaos_events
-- The chat events of the run's users (their user ids share a prefix) and their tasks' result events; waiting: pending for the user's daily budget, refused (the worker's OverBudget finish: the error `budget: `, due the next UTC day) or behind such an event of the user (a user's events are claimed in order).
SELECT e.id, e.user_id, e.source_id, e.status, e.received_at, e.recorded_at, e.payload, e.error, e.attempts,
       (e.status = 'pending' AND EXISTS (
           SELECT 1 FROM events w
           WHERE w.user_id = e.user_id AND w.status = 'pending' AND w.id <= e.id
             AND starts_with(w.error, 'budget: ') AND w.next_attempt_at > now())) AS waiting
FROM events e WHERE e.user_id LIKE %(prefix)s AND e.source IN ('chat', 'task') ORDER BY e.id

-- name: chaos_runs
-- Every run of the run's users, failed attempts included.
SELECT id, user_id, partition, event_ids, started_at, finished_at, outcome, turns
FROM runs WHERE user_id LIKE %(prefix)s ORDER BY user_id, started_at

-- name: chaos_outbox
-- Every message written for the run's users, and whether it was delivered.
SELECT id, user_id, run_id, status, delivery_id, delivered_at
FROM outbox WHERE user_id LIKE %(prefix)s ORDER BY id

-- name: chaos_unsettled
-- What still moves for the run's users: events not finished (those waiting for their user's daily budget, as chaos_events says, wait for the next UTC day, not for the stack), messages not delivered, background tasks not ended and reported (before their deadline), approval requests neither answered nor expired.
SELECT (SELECT count(*) FROM events e WHERE e.user_id LIKE %(prefix)s AND e.status IN ('pending', 'running')
          AND NOT EXISTS (
              SELECT 1 FROM events w
              WHERE w.user_id = e.user_id AND w.status = 'pending' AND w.id <= e.id
                AND starts_with(w.error, 'budget: ') AND w.next_attempt_at > now()))::int AS events,
       (SELECT count(*) FROM outbox WHERE user_id LIKE %(prefix)s AND status IN ('pending', 'sending'))::int AS messages,
       (SELECT count(*) FROM tasks WHERE user_id LIKE %(prefix)s AND mode = 'background'
          AND (finished_at IS NULL OR reported_at IS NULL) AND deadline > now())::int AS tasks,
       (SELECT count(*) FROM approvals WHERE user_id LIKE %(prefix)s AND answer IS NULL)::int AS approvals

-- name: chaos_held
-- The events topic's partitions a worker holds in the ledger (its instance id is the holder).
SELECT partition FROM partitions WHERE holder = %(holder)s ORDER BY partition

-- name: chaos_budget_notices
-- The budget notices the run's users were sent (one per user and UTC day), and their outbox rows (run 0).
SELECT n.user_id, n.day, n.profile,
       (SELECT count(*) FROM outbox o WHERE o.user_id = n.user_id AND o.run_id = 0
          AND starts_with(o.body, 'Your daily model budget'))::int AS messages
FROM budget_notices n WHERE n.user_id LIKE %(prefix)s ORDER BY n.user_id, n.day

-- name: chaos_tasks
-- The run's users' background tasks; open: not ended or not reported, and before its deadline (the reaper's to end).
SELECT id, user_id, status, attempts, error, finished_at, reported_at,
       (finished_at IS NULL OR reported_at IS NULL) AND deadline > now() AS open
FROM tasks WHERE user_id LIKE %(prefix)s AND mode = 'background' ORDER BY created_at

-- name: chaos_approval_questions
-- The open approval requests of the run's users whose question was delivered, with its text (the person reads request_id and token there).
SELECT a.request_id, a.user_id, a.due, o.body
FROM approvals a
JOIN outbox o ON o.user_id = a.user_id AND o.status = 'delivered' AND strpos(o.body, 'request_id: ' || a.request_id) > 0
WHERE a.user_id LIKE %(prefix)s AND a.answer IS NULL

-- name: chaos_approvals
-- Every approval request of the run's users and the answer that stands.
SELECT request_id, user_id, answer, answered_via, due, answered_at
FROM approvals WHERE user_id LIKE %(prefix)s ORDER BY created_at
