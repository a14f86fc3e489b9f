-- The claim rules: which pending events a worker takes for a run, and how a claim is given back.
-- Read services/vigil/ledger/claims.py for the rules.
--
-- Time: coalesce(%(now)s, now()) is the caller's clock (vigil.clock), the database's only
-- when the caller passes none; stamps of record (finished_at, claimed_at, acquired_at) are
-- the database's own (docs/architecture.md, "Time").

-- name: mark_exhausted_dead
-- Claim rule 2: a pending row whose attempts reached the bound is dead (a poison event must never silently mute an agent).
WITH owned AS (
    -- FOR SHARE: a takeover must not slip between this check and the update.
    SELECT p.topic, p.partition FROM partitions p
    JOIN unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
      ON p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch
    -- Locks taken in one global order (as lock_epochs and take_over do): no deadlock with a
    -- takeover of several partitions.
    ORDER BY p.topic, p.partition
    FOR SHARE OF p
),
exhausted AS MATERIALIZED (
    -- Through events_retries (its predicate spelled out so the planner can use it): the rows
    -- that were tried, not every pending row; then a home probe per row (LIMIT 1: never a
    -- join over every user of the owned partitions).
    SELECT e.id, e.status FROM events e
    CROSS JOIN LATERAL (
        SELECT 1 FROM users u JOIN owned o ON o.topic = u.home_topic AND o.partition = u.home_partition
        WHERE u.user_id = e.user_id LIMIT 1
    ) mine
    WHERE e.status = 'pending' AND e.attempts > 0 AND e.attempts >= %(max_attempts)s
      -- Not a lone last attempt a takeover handed back while its verdict waits: the worker
      -- that lost it may be alive and give it back (forgive_lost_claims).
      AND NOT (e.claim_epoch IS NOT NULL AND coalesce(e.next_attempt_at > coalesce(%(now)s::timestamptz, now()), false))
)
UPDATE events e
SET status = 'dead', finished_at = now(),
    error = 'dead after ' || e.attempts || ' attempts' || coalesce(': ' || e.error, '')
FROM exhausted x
-- Join clauses only (see claim): the rows by id, whatever the statistics say about pending.
-- The live queue only (see claim).
WHERE e.id = x.id AND e.status = x.status AND e.attempts >= %(max_attempts)s AND e.status IN ('pending', 'running')
RETURNING e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.received_at, e.occurred_at, e.error

-- name: plan_claim_as_probes
-- First in the claim's transaction: every statement after it reads by index probes, never by a bitmap or a sequential scan (transaction-local settings).
-- The claim's steps are bounded probes (LIMIT 1 per user, the ids of claim_chosen). On a
-- churned queue the statistics make the planner believe a handful of rows live in it, and it
-- then preferred a bitmap scan of every pending row after the user, sorted, for each step of
-- the skip scan (343 steps of 1,170 rows each: 208 ms for a pass of 139 users, where the
-- probes take a few), or a sequential scan of the whole bloated queue for the write.
SELECT set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true)

-- name: claim
-- Claim rules 2-4, the choice (claim_chosen writes it): the rows of up to %(max_users)s users of the partitions this worker owns at the given epochs, taking users in user_id order after %(after)s (up to %(until)s if given): a round-robin cursor, so a pass costs a few index probes per user it looks at and stops once it has enough, however many users wait.
WITH RECURSIVE owned AS (
    -- FOR SHARE, held to commit: a takeover (UPDATE of this row) waits for the claim, and a
    -- worker whose epoch is stale matches no row here and claims nothing.
    SELECT p.topic, p.partition, p.epoch FROM partitions p
    JOIN unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
      ON p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch
    -- Locks taken in one global order (as lock_epochs and take_over do): no deadlock with a
    -- takeover of several partitions.
    ORDER BY p.topic, p.partition
    FOR SHARE OF p
),
pending_users (user_id) AS (
    -- Users with pending rows after the cursor, found by skipping through
    -- events_pending_by_user one user at a time. Evaluated lazily: the LIMIT below stops the
    -- skip scan as soon as enough users are claimable, so a backlog of many waiting users
    -- does not make every pass read all of them (passes would slow down as work piles up).
    (SELECT user_id FROM events
     WHERE status = 'pending' AND user_id > %(after)s AND (%(until)s::text IS NULL OR user_id <= %(until)s::text)
     ORDER BY user_id LIMIT 1)
    UNION ALL
    SELECT (SELECT e.user_id FROM events e
            WHERE e.status = 'pending' AND e.user_id > p.user_id AND (%(until)s::text IS NULL OR e.user_id <= %(until)s::text)
            ORDER BY e.user_id LIMIT 1)
    FROM pending_users p WHERE p.user_id IS NOT NULL
),
waiting AS (
    -- Users of owned partitions whose oldest pending row is claimable now, not already running
    -- here (rule 4) or anywhere under the current epoch.
    -- Every step is a probe for the user at hand, in skip-scan order, so the LIMIT stops the
    -- whole pipeline early: the LIMIT 1 / OFFSET 0 keep the planner from turning the probes
    -- into joins over every user of the owned partitions or every running row.
    SELECT p.user_id, o.topic, o.partition, o.epoch
    FROM pending_users p
    CROSS JOIN LATERAL (
        SELECT o.topic, o.partition, o.epoch FROM users u
        JOIN owned o ON o.topic = u.home_topic AND o.partition = u.home_partition
        WHERE u.user_id = p.user_id LIMIT 1
    ) o
    CROSS JOIN LATERAL (
        SELECT e.attempts, e.lost_claims, e.next_attempt_at, e.recorded_at FROM events e
        WHERE e.user_id = p.user_id AND e.status = 'pending' ORDER BY e.id LIMIT 1
    ) f
    WHERE p.user_id IS NOT NULL
      -- busy: a JSON array of user ids (psycopg's text[] dumper took 0.76 ms for 1,000 of them, every pass).
      -- NOT IN a subquery: one hash table per pass (a hashed SubPlan), a probe per user. As
      -- <> ALL(array) it compared every waiting user with every busy one: 16 of a 25 ms pass
      -- for 1,000 waiting users with 500 busy.
      AND p.user_id NOT IN (SELECT jsonb_array_elements_text(%(busy)s::jsonb))
      AND coalesce(f.next_attempt_at, %(now)s::timestamptz, now()) <= coalesce(%(now)s::timestamptz, now())
      AND CASE WHEN f.attempts > 0
               -- Rule 3: the oldest pending row is a retry whose backoff ended. Rule 2: never
               -- one whose attempts are exhausted (mark_exhausted_dead makes it dead). Never
               -- the last attempt of a row lost with its worker before: that one runs alone
               -- (claim_alone).
               THEN f.attempts < %(max_attempts)s AND NOT (f.lost_claims > 0 AND f.attempts = %(max_attempts)s - 1)
               -- Fresh rows once the oldest has waited out the batch window (quick messages share one run).
               ELSE f.recorded_at <= coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(window_s)s) END
      AND NOT EXISTS (SELECT 1 FROM events r WHERE r.user_id = p.user_id AND r.status = 'running' AND r.claim_epoch = o.epoch
                      OFFSET 0)
    LIMIT %(max_users)s
),
chosen AS MATERIALIZED (
    -- Each waiting user's first pending rows in order: a retry alone; otherwise fresh rows up
    -- to the batch limit, stopping before any retry row, so runs follow event order per user.
    -- MATERIALIZED: evaluated once. On a queue table the statistics are often stale (no
    -- pending rows at the last ANALYZE); once they made the planner scan every pending row
    -- and run this whole pipeline again for each (51 s for one pass).
    SELECT b.id, w.user_id, w.topic, w.partition, w.epoch
    FROM waiting w
    CROSS JOIN LATERAL (
        SELECT f.id, f.attempts, f.next_attempt_at,
               row_number() OVER (ORDER BY f.id) AS n,
               min(CASE WHEN f.attempts > 0 THEN f.id END) OVER () AS first_retry
        FROM (SELECT e.id, e.attempts, e.next_attempt_at FROM events e
              WHERE e.user_id = w.user_id AND e.status = 'pending' ORDER BY e.id LIMIT %(batch_max)s) f
    ) b
    WHERE (b.n = 1 AND b.attempts > 0)
       OR (b.attempts = 0 AND (b.first_retry IS NULL OR b.id < b.first_retry) AND coalesce(b.next_attempt_at, %(now)s::timestamptz, now()) <= coalesce(%(now)s::timestamptz, now()))
)
-- Chosen, not yet claimed: claim_chosen writes these rows in the same transaction, while the
-- FOR SHARE above holds the epochs. The next pass starts after the last user chosen here, in
-- the ledger's own text order.
SELECT c.id, c.user_id, c.topic, c.partition, c.epoch, max(c.user_id) OVER () AS cursor FROM chosen c

-- name: claim_chosen
-- The claim's write: the rows the claim statement chose (%(ids)b), each claimed under its home partition's epoch (%(epochs)s, a JSON object from user id to epoch), in the claim's transaction. Sent unprepared (claims.py), so the ids reach the planner as a constant: every plan it can pick probes the primary key or hashes the ids, whatever the queue's statistics say.
-- A separate statement because, as a join of this UPDATE with the chosen rows, a queue
-- analyzed while nearly empty made the planner compare every chosen row with every live row
-- (100 million comparisons, 4.4 s, for 5,000 rows claimed from 20,000).
UPDATE events e
SET status = 'running', attempts = e.attempts + 1, claim_epoch = (%(epochs)s::jsonb ->> e.user_id)::bigint,
    claimed_at = now(), next_attempt_at = NULL
-- Pending, spelled as the live queue (events_live) minus running: a plain status = 'pending'
-- would match the partial indexes' predicate, and on such statistics the planner walked all of
-- events_pending_by_user comparing each row with every id.
-- The ids in binary: as text psycopg writes each in Python, 1.1 ms for the 2,300 of a pass at
-- the e2e bench's saturation, 0.24 ms in binary.
WHERE e.id = ANY(%(ids)b::bigint[]) AND e.status IN ('pending', 'running') AND e.status <> 'running'
RETURNING e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.received_at, e.recorded_at,
          e.attempts, e.transient_failures, e.claim_epoch

-- name: alone_due
-- Claim rule 3, the last attempt of an event lost with its worker before: when the first of these (on the owned partitions, at the user's turn: its oldest pending row or the first event of its run in progress, a live journal; and no run of the user in flight, as claim_alone asks) may be claimed. NULL: none waits. A row announced due that claim_alone cannot take would drain the worker for nothing, and again at every scan: the user's run in flight, released by the drain, claimed again, released again.
WITH owned AS (
    SELECT p.topic, p.partition FROM partitions p
    JOIN unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
      ON p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch
)
SELECT min(coalesce(e.next_attempt_at, %(now)s::timestamptz, now())) AS at
FROM events e
-- The user's home by primary key, per tried row (OFFSET 0: never a join that starts from
-- every user of the owned partitions, which read 3,000 users to find no row).
CROSS JOIN LATERAL (SELECT u.home_topic, u.home_partition FROM users u WHERE u.user_id = e.user_id OFFSET 0) u
-- Through events_retries (its predicate spelled out): the tried rows only.
WHERE e.status = 'pending' AND e.attempts > 0 AND e.attempts = %(max_attempts)s - 1 AND e.lost_claims > 0
  AND EXISTS (SELECT 1 FROM owned o WHERE o.topic = u.home_topic AND o.partition = u.home_partition)
  AND (NOT EXISTS (SELECT 1 FROM events o WHERE o.user_id = e.user_id AND o.status = 'pending' AND o.id < e.id)
       OR EXISTS (SELECT 1 FROM run_journal j WHERE j.user_id = e.user_id AND j.finished_at IS NULL AND j.step = 1
                    AND (j.run_key = e.user_id || ':' || e.id OR starts_with(j.run_key, e.user_id || ':' || e.id || '~'))))
  AND NOT EXISTS (SELECT 1 FROM events r WHERE r.user_id = e.user_id AND r.status = 'running')

-- name: claim_alone
-- Claim rule 3, the last attempt of an event lost with its worker before: one such row, claimed by a worker with no other run in flight (the runner sees to that), so that if it crashes the worker again, the crash is its own and no other event pays an attempt for it.
WITH owned AS (
    -- FOR SHARE, as in claim: fenced by the epochs, locks in one global order.
    SELECT p.topic, p.partition, p.epoch FROM partitions p
    JOIN unnest(%(topics)s::text[], %(partitions)s::int[], %(epochs)s::bigint[]) AS w(topic, partition, epoch)
      ON p.topic = w.topic AND p.partition = w.partition AND p.epoch = w.epoch
    ORDER BY p.topic, p.partition
    FOR SHARE OF p
),
chosen AS MATERIALIZED (
    SELECT e.id, e.status, o.topic, o.partition, o.epoch
    FROM events e
    CROSS JOIN LATERAL (
        SELECT o.topic, o.partition, o.epoch FROM users u
        JOIN owned o ON o.topic = u.home_topic AND o.partition = u.home_partition
        WHERE u.user_id = e.user_id LIMIT 1
    ) o
    WHERE e.status = 'pending' AND e.attempts > 0 AND e.attempts = %(max_attempts)s - 1 AND e.lost_claims > 0
      AND coalesce(e.next_attempt_at, %(now)s::timestamptz, now()) <= coalesce(%(now)s::timestamptz, now())
      -- At the user's turn (runs follow event order per user; the run in progress, its live
      -- journal's first event, goes first: an operator's retry of an older dead event does not
      -- overtake it) and no run of the user (rule 4).
      AND (NOT EXISTS (SELECT 1 FROM events b WHERE b.user_id = e.user_id AND b.status = 'pending' AND b.id < e.id)
           OR EXISTS (SELECT 1 FROM run_journal j WHERE j.user_id = e.user_id AND j.finished_at IS NULL AND j.step = 1
                        AND (j.run_key = e.user_id || ':' || e.id OR starts_with(j.run_key, e.user_id || ':' || e.id || '~'))))
      AND NOT EXISTS (SELECT 1 FROM events r WHERE r.user_id = e.user_id AND r.status = 'running' AND r.claim_epoch = o.epoch)
    ORDER BY e.next_attempt_at NULLS FIRST, e.id
    LIMIT 1
)
UPDATE events e
SET status = 'running', attempts = e.attempts + 1, claim_epoch = c.epoch, claimed_at = now(), next_attempt_at = NULL
FROM chosen c
WHERE e.id = c.id AND e.status = c.status AND e.status IN ('pending', 'running')
RETURNING e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.received_at, e.recorded_at,
          e.attempts, e.transient_failures, e.claim_epoch, c.topic AS home_topic, c.partition AS home_partition

-- name: backoff_ends
-- When rows of these partitions that wait out a backoff become claimable: read once at takeover, whose hand-back set backoffs this process did not choose (the runner wakes at each; its own failures it times itself).
SELECT DISTINCT e.next_attempt_at AS at
FROM events e
JOIN users u ON u.user_id = e.user_id
JOIN unnest(%(topics)s::text[], %(partitions)s::int[]) AS w(topic, partition)
  ON w.topic = u.home_topic AND w.partition = u.home_partition
WHERE e.status = 'pending' AND e.next_attempt_at > coalesce(%(now)s::timestamptz, now())
ORDER BY 1
LIMIT 1000

-- name: claim_more
-- Fold: at a model-turn boundary, claim the user's fresh pending rows under the run's own epoch: those naming no session, or naming the session the run is talking in (%(session_id)s; a reply to the conversation in progress).
WITH owned AS (
    SELECT 1 FROM partitions p
    WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s
    FOR SHARE
)
UPDATE events e
SET status = 'running', attempts = e.attempts + 1, claim_epoch = %(epoch)s, claimed_at = now()
WHERE e.user_id = %(user_id)s AND e.status = 'pending' AND e.attempts = 0 AND e.lost_claims = 0
  AND e.source = ANY(%(sources)s) AND (e.session_id IS NULL OR e.session_id = %(session_id)s)
  AND EXISTS (SELECT 1 FROM owned)
RETURNING e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.received_at, e.recorded_at,
          e.attempts, e.transient_failures, e.claim_epoch

-- name: claim_ids
-- A replay's adoption: the events its journal started with (or folded) that the claim did not bring, claimed by id under the run's own epoch (rows handed back after a crash are pending again, with their attempts), never for an event's last attempt.
WITH owned AS (
    SELECT 1 FROM partitions p
    WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s
    FOR SHARE
)
UPDATE events e
SET status = 'running', attempts = e.attempts + 1, claim_epoch = %(epoch)s, claimed_at = now(), next_attempt_at = NULL
WHERE e.id = ANY(%(ids)s) AND e.user_id = %(user_id)s AND e.status IN ('pending', 'running') AND e.status <> 'running'
  -- Never an event's last attempt: that one runs alone (claim rule 3), not in another's replay.
  AND e.attempts + 1 < %(max_attempts)s
  AND EXISTS (SELECT 1 FROM owned)
RETURNING e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.received_at, e.recorded_at,
          e.attempts, e.transient_failures, e.claim_epoch

-- name: due_alone
-- Is this event pending for claim rule 3's lone last attempt (lost with its worker before)?
SELECT 1 AS due FROM events e
WHERE e.id = %(id)s AND e.status = 'pending' AND e.attempts > 0 AND e.attempts = %(max_attempts)s - 1 AND e.lost_claims > 0

-- name: claim_ids_alone
-- A batch replayed alone on its lead's last attempt: the batch-mates claimed by id under the lead's epoch, their attempts not counted (the replay is the lead's, on an attempt the lead gives back: give_back_attempt). Never a dead event's.
WITH owned AS (
    SELECT 1 FROM partitions p
    WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s
    FOR SHARE
)
UPDATE events e
SET status = 'running', claim_epoch = %(epoch)s, claimed_at = now(), next_attempt_at = NULL
WHERE e.id = ANY(%(ids)s) AND e.user_id = %(user_id)s AND e.status = 'pending'
  AND e.attempts < %(max_attempts)s
  AND EXISTS (SELECT 1 FROM owned)
RETURNING e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.received_at, e.recorded_at,
          e.attempts, e.transient_failures, e.claim_epoch

-- name: give_back_attempt
-- The lead of a batch replayed alone: its last attempt's count given back (it ran in company only, so far), fenced by the claim's epoch.
UPDATE events e
SET attempts = e.attempts - 1
WHERE e.id = ANY(%(ids)s) AND e.status = 'running' AND e.claim_epoch = %(epoch)s AND e.attempts > 0
  AND EXISTS (SELECT 1 FROM partitions p
              WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s)

-- name: forgive_lost_claims
-- A worker that lost a partition while alive cancelled the runs of these events (claimed under %(epoch)s); a takeover came first and handed them back as lost with a crashed worker (hand_back_stale_claims). It was no crash: the loss uncounted, a lone last attempt's count given back (a verdict of death waits for this), and the journal of a batch replayed alone unstamped (else its next lone attempt takes the stamp for a crash alone); so the event's last attempt, or the batch's replay alone, runs again. Only rows no one wrote since (a claim, release or finish writes claim_epoch); a non-last attempt stays counted (the hand-back's row does not say whether it gave one back). Never a dead row.
WITH forgiven AS (
    UPDATE events e
    SET lost_claims = e.lost_claims - 1,
        attempts = least(e.attempts, %(max_attempts)s - 1),
        claim_epoch = NULL,
        next_attempt_at = coalesce(%(now)s::timestamptz, now()),
        error = 'claim given back: its worker lost partition ' || %(partition)s || ' alive (epoch ' || e.claim_epoch || ') and cancelled the run'
    WHERE e.id = ANY(%(ids)s) AND e.status = 'pending' AND e.claim_epoch = %(epoch)s AND e.lost_claims > 0
      AND EXISTS (SELECT 1 FROM users u
                  WHERE u.user_id = e.user_id AND u.home_topic = %(topic)s AND u.home_partition = %(partition)s)
    RETURNING e.id, e.user_id
),
unstamped AS (
    UPDATE run_journal j SET alone_at = NULL
    FROM forgiven f
    WHERE j.user_id = f.user_id AND j.step = 1 AND j.finished_at IS NULL AND j.alone_at IS NOT NULL
      AND j.lead_event = f.id
)
SELECT id FROM forgiven

-- name: release_claim
-- A graceful release (partition revoked mid-run, worker shutting down): back to pending, the attempt not counted. The events of every run the worker cancels for one partition at one epoch, in one statement. A batch's journal its lead took up alone (its stamp) is unstamped: the run was released, it did not crash alone, so its next lone attempt replays it whole again instead of splitting it under new keys.
WITH unstamped AS (
    UPDATE run_journal j SET alone_at = NULL
    FROM events e
    WHERE e.id = ANY(%(ids)s) AND e.status = 'running' AND e.claim_epoch = %(epoch)s
      AND j.user_id = e.user_id AND j.lead_event = e.id AND j.step = 1 AND j.finished_at IS NULL
      AND j.alone_at IS NOT NULL
      AND EXISTS (SELECT 1 FROM partitions p WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s)
)
UPDATE events
SET status = 'pending', claim_epoch = NULL, attempts = greatest(attempts - 1, 0)
WHERE id = ANY(%(ids)s) AND status = 'running' AND claim_epoch = %(epoch)s
  AND EXISTS (SELECT 1 FROM partitions p WHERE p.topic = %(topic)s AND p.partition = %(partition)s AND p.epoch = %(epoch)s)
