-- Approvals: the answer and the expiry share the key request_id; the first stored stands.
-- Every write below moves a row only out of "answer IS NULL", so nothing overwrites it.

-- name: approval_create
-- Written by the worker's fenced finish when a tool call needs approval.
INSERT INTO approvals (request_id, user_id, session_id, run_id, tool, tool_use_id, args_hash, due, on_expiry)
VALUES (%(request_id)s, %(user_id)s, %(session_id)s, %(run_id)s, %(tool)s, %(tool_use_id)s, %(args_hash)s, %(due)s, %(on_expiry)s)

-- name: approval_answer_in_time
-- Store a human answer if it was received before the deadline (received, not processed: queue lag never expires it), and the path it came by (api | chat | action).
UPDATE approvals
SET answer = %(answer)s, answered_at = now(), received_at = %(received_at)s, answered_via = %(via)s
WHERE request_id = %(request_id)s AND answer IS NULL AND due > %(received_at)s
RETURNING answer

-- name: approval_expire
-- Store "expired" once the deadline has passed at %(at)s (a late answer, by the path it came: %(via)s; or the expiry timer: NULL).
UPDATE approvals
SET answer = 'expired', answered_at = now(), received_at = COALESCE(received_at, %(received_at)s), answered_via = %(via)s
WHERE request_id = %(request_id)s AND answer IS NULL AND due <= %(at)s
RETURNING answer

-- name: approval_approve_on_expiry
-- on_expiry = approve: the deadline passing counts as a yes.
UPDATE approvals
SET answer = 'yes', answered_at = now()
WHERE request_id = %(request_id)s AND answer IS NULL AND due <= %(at)s AND on_expiry = 'approve'
RETURNING answer

-- name: approval_escalate
-- on_expiry = escalate, at every deadline: ask again with a new deadline instead of expiring (fail closed: until a person answers or an operator denies).
UPDATE approvals
SET escalations = escalations + 1, due = %(new_due)s
WHERE request_id = %(request_id)s AND answer IS NULL AND due <= %(at)s AND on_expiry = 'escalate'
RETURNING escalations, due

-- name: approval_get
-- One approval request as stored.
SELECT request_id, user_id, session_id, run_id, tool, tool_use_id, args_hash, due, on_expiry,
       escalations, answer, answered_at, received_at, created_at, answered_via
FROM approvals WHERE request_id = %(request_id)s

-- name: approval_open_for_session
-- The open request a session waits on (a chat reply naming the session answers it); none: the session waits on nothing.
SELECT request_id FROM approvals
WHERE user_id = %(user_id)s AND session_id = %(session_id)s AND answer IS NULL
ORDER BY created_at DESC
LIMIT 1

-- name: approval_asked_by_delivery
-- The request a question's delivery asked (its actions name it), whatever its state: a chat reply naming that delivery answers it, or is told the answer that stands.
SELECT actions -> 0 ->> 'request_id' AS request_id FROM outbox
WHERE user_id = %(user_id)s AND delivery_id = %(delivery_id)s AND actions -> 0 ->> 'request_id' IS NOT NULL
ORDER BY id DESC
LIMIT 1

-- name: approval_asked_last_in_session
-- The request the session's newest message asked, if its newest message is a question: a reply naming only the session, when the agent said nothing since asking, replies to it.
SELECT actions -> 0 ->> 'request_id' AS request_id
FROM (SELECT actions FROM outbox WHERE user_id = %(user_id)s AND session_id = %(session_id)s ORDER BY id DESC LIMIT 1) AS newest
WHERE actions -> 0 ->> 'request_id' IS NOT NULL

-- name: approvals_list
-- Operators (`vigil approvals list`): requests, newest first; only the open ones unless %(all)s; one user's if %(user_id)s is set.
SELECT request_id, user_id, session_id, tool, due, on_expiry, escalations, answer, answered_at, created_at
FROM approvals
WHERE (%(all)s OR answer IS NULL) AND (%(user_id)s::text IS NULL OR user_id = %(user_id)s)
ORDER BY created_at DESC
LIMIT %(limit)s

-- name: approval_operator_deny
-- Operators (`vigil approvals deny`): an open request counts as a no. Zero rows: it was already answered or expired.
UPDATE approvals
SET answer = 'no', answered_at = now(), received_at = now(), answered_via = 'operator'
WHERE request_id = %(request_id)s AND answer IS NULL
RETURNING user_id

-- name: approval_expiry_now
-- After an operator's answer: the request's expiry timer fires at %(at)s (now), and its wake-up carries the standing answer to the session.
UPDATE timers
SET due = date_trunc('second', %(at)s::timestamptz), updated_at = now()
WHERE user_id = %(user_id)s AND kind = 'approval_expiry' AND fixed_key = %(request_id)s AND NOT done
RETURNING id

-- name: approval_ids_answerable
-- Ids an answer may still name: open requests, and those due after %(since)s (a retry of an answer).
-- The answer route's miss guard reads it under a flood of made-up ids, at most once a second.
SELECT request_id FROM approvals WHERE answer IS NULL OR due > %(since)s
