-- The finish: everything a run decided, written in one fenced transaction with its events'
-- new state (see services/vigil/worker/finish.py for the order and what a crash leaves).
--
-- Time: coalesce(%(now)s, now()) is the caller's clock (vigil.clock), the database's only
-- when the caller passes none; stamps of record (finished_at, claimed_at, acquired_at) are
-- the database's own (docs/architecture.md, "Time").

-- name: finish_runs
-- Group commit of the runs whose epochs were checked: every run's audit row, the done runs' events and their outbox rows, in one statement for the whole group (one round trip however many runs). Returns each run's id and how many of its events were still claimed; a run's other writes follow by its id.
-- Parameters in binary (the "b" placeholders): as text, psycopg quotes every element of every array in
-- Python, 40 us of the worker's CPU per run (a fifth of a single-event run's); binary, 12.
WITH new_runs AS (
    INSERT INTO runs (user_id, topic, partition, epoch, worker, event_ids, session_id, started_at, finished_at,
                      outcome, error, turns, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                      tool_calls, profile, profile_version)
    SELECT r.user_id, r.topic, r.partition, r.epoch, %(worker)b, r.event_ids::bigint[], r.session_id, r.started_at, now(),
           r.outcome, r.error, r.turns, r.input_tokens, r.output_tokens, r.cache_read_tokens, r.cache_write_tokens,
           r.tool_calls, r.profile, r.profile_version
    FROM unnest(%(user_id)b::text[], %(topic)b::text[], %(partition)b::int[], %(epoch)b::bigint[], %(event_ids)b::text[],
                %(session_id)b::text[], %(started_at)b::timestamptz[], %(outcome)b::text[], %(error)b::text[],
                %(turns)b::int[], %(input_tokens)b::int[], %(output_tokens)b::int[], %(cache_read_tokens)b::int[],
                %(cache_write_tokens)b::int[], %(tool_calls)b::int[], %(profile)b::text[], %(profile_version)b::int[])
         WITH ORDINALITY AS r(user_id, topic, partition, epoch, event_ids, session_id, started_at, outcome, error, turns,
                              input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, tool_calls, profile,
                              profile_version, n)
    ORDER BY r.n
    RETURNING id, user_id, epoch, outcome, event_ids
),
done_runs AS (
    -- The done runs by user, as one JSON object: each event row finds its run by a lookup in
    -- it, not by a join the planner may order either way.
    SELECT jsonb_object_agg(user_id, jsonb_build_array(id, epoch)) AS by_user FROM new_runs WHERE outcome <> 'failed'
),
done AS (
    -- A run's events are done only while still claimed under its epoch; fewer rows than it
    -- claimed means the claim is no longer ours (the caller refuses the run).
    -- Driven by the flat id list (primary-key probes) and nothing else: joined with the runs,
    -- the planner once matched every running row against every run of the group, and a
    -- generic plan walked events_running_by_user comparing each running row with every id
    -- of the group (5.6 s for 7,334 ids among 32,725 running rows). Running is spelled as the
    -- live queue minus pending so that no partial index's predicate matches.
    UPDATE events e
    SET status = 'done', finished_at = now(), error = NULL,
        run_id = ((SELECT by_user FROM done_runs) -> e.user_id ->> 0)::bigint
    WHERE e.id = ANY(%(done_ids)b::bigint[]) AND e.status IN ('pending', 'running') AND e.status <> 'pending'
      AND e.claim_epoch = ((SELECT by_user FROM done_runs) -> e.user_id ->> 1)::bigint
    RETURNING e.run_id
),
messages AS (
    -- The messages the done runs decided to send, under the epoch they were written with
    -- (a run has one user: its messages are matched to its row by user).
    -- traceparent: the run's trace context when traces are on (the delivery continues it).
    INSERT INTO outbox (user_id, run_id, epoch, body, urgent, traceparent)
    SELECT r.user_id, r.id, r.epoch, m.body, m.urgent, m.traceparent
    FROM unnest(%(message_user)b::text[], %(message_body)b::text[], %(message_urgent)b::boolean[],
                %(message_trace)b::text[])
         WITH ORDINALITY AS m(user_id, body, urgent, traceparent, n)
    JOIN new_runs r ON r.user_id = m.user_id
    ORDER BY m.n
)
SELECT r.id, r.user_id, count(d.run_id)::int AS done
FROM new_runs r LEFT JOIN done d ON d.run_id = r.id
GROUP BY r.id, r.user_id

-- name: insert_timer
-- A follow-up or approval expiry set by the run (%(run_id)s: the console's link; the run's trace context when traces are on). Re-setting the same id replaces a timer that has not fired yet.
INSERT INTO timers AS t (id, user_id, kind, due, catch_up, payload, fixed_key, traceparent, run_id)
-- Due times are whole seconds: round up, so a follow-up never fires before the time asked for.
VALUES (%(id)s, %(user_id)s, %(kind)s, date_trunc('second', %(due)s::timestamptz + interval '999999 microseconds'),
        %(catch_up)s, %(payload)s, %(fixed_key)s, %(traceparent)s, %(run_id)s)
ON CONFLICT (user_id, id) DO UPDATE
SET due = EXCLUDED.due, payload = EXCLUDED.payload, fixed_key = EXCLUDED.fixed_key, kind = EXCLUDED.kind,
    catch_up = EXCLUDED.catch_up, traceparent = EXCLUDED.traceparent, run_id = EXCLUDED.run_id, updated_at = now()
WHERE NOT t.done

-- name: upsert_memory
-- The memory tool's create/str_replace/insert/rename target, written by run %(run_id)s (the console's link) or a memory review, task %(task_id)s; the change, with the content it replaced, goes to memory_history in the same statement (none when nothing changed).
WITH old AS (
    SELECT content FROM memory WHERE user_id = %(user_id)s AND path = %(path)s FOR UPDATE
), written AS (
    INSERT INTO memory (user_id, path, content, run_id) VALUES (%(user_id)s, %(path)s, %(content)s, %(run_id)s)
    ON CONFLICT (user_id, path) DO UPDATE SET content = EXCLUDED.content, run_id = EXCLUDED.run_id, updated_at = now()
)
INSERT INTO memory_history (user_id, path, old_content, new_content, run_id, task_id)
SELECT %(user_id)s, %(path)s, (SELECT content FROM old), %(content)s, %(run_id)s, %(task_id)s
WHERE (SELECT content FROM old) IS DISTINCT FROM %(content)s::text

-- name: delete_memory
-- The memory tool's delete (and rename's source); the deleted content goes to memory_history in the same statement.
WITH gone AS (
    DELETE FROM memory WHERE user_id = %(user_id)s AND path = %(path)s RETURNING content
)
INSERT INTO memory_history (user_id, path, old_content, new_content, run_id, task_id)
SELECT %(user_id)s, %(path)s, content, NULL, %(run_id)s, %(task_id)s FROM gone

-- name: finish_failed
-- Finish of a failed attempt: back to pending with the error and a backoff; a transient failure gives its attempt back, and so does one waiting for its daily budget. Either also unstamps a batch's journal its lead took up alone: that run did not fail alone (the model or the ledger was unavailable, the budget spent), so its next lone attempt replays it whole again instead of splitting it under new keys.
WITH unstamped AS (
    UPDATE run_journal j SET alone_at = NULL
    FROM events e
    WHERE (%(transient)s OR %(waiting)s)
      AND e.id = ANY(%(ids)s) AND e.status = 'running' AND e.claim_epoch = %(epoch)s
      AND j.user_id = e.user_id AND j.lead_event = e.id AND j.step = 1 AND j.finished_at IS NULL
      AND j.alone_at IS NOT NULL
)
UPDATE events
SET status = 'pending', claim_epoch = NULL, error = %(error)s, run_id = %(run_id)s,
    next_attempt_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(backoff_s)s),
    attempts = CASE WHEN %(transient)s OR %(waiting)s THEN attempts - 1 ELSE attempts END,
    transient_failures = transient_failures + CASE WHEN %(transient)s THEN 1 ELSE 0 END
WHERE id = ANY(%(ids)s) AND status = 'running' AND claim_epoch = %(epoch)s
