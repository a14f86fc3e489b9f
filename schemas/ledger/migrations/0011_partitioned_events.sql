-- 0011: events stored in two parts, the live queue (pending, running) and the finished rows
-- partitioned by day (retention drops a day instead of deleting row by row), and the dedup
-- key moved to its own narrow table, event_keys, which outlives the partitions.
-- An existing ledger is converted in place: every row keeps its id and columns, every event's
-- key goes to event_keys with the event's recorded_at (so keys expire a dedup window after
-- their event was recorded), and the identity continues after the highest id.
-- This copies the events table once: on a large ledger, run it in a quiet hour.

-- The old table steps aside, freeing its index and sequence names.
ALTER TABLE events RENAME TO events_unpartitioned;
ALTER INDEX events_pkey RENAME TO events_unpartitioned_pkey;
ALTER INDEX events_dedup_key RENAME TO events_unpartitioned_dedup_key;
ALTER INDEX events_pending_by_user RENAME TO events_unpartitioned_pending_by_user;
ALTER INDEX events_running_by_user RENAME TO events_unpartitioned_running_by_user;
ALTER INDEX events_dead RENAME TO events_unpartitioned_dead;
ALTER INDEX events_retries RENAME TO events_unpartitioned_retries;
ALTER SEQUENCE events_id_seq RENAME TO events_unpartitioned_id_seq;

-- events: one row per event, whatever its source. Stored in two parts by status, so the
-- queue the workers claim from stays small however much history is kept:
--   events_live      pending and running rows: every claim, finish and takeover statement
--                    names the status it expects, so the planner reads this part only;
--   events_finished  done and dead rows, partitioned by the UTC day of finished_at
--                    (events_finished_pYYYYMMDD, made ahead by the scheduler with
--                    ensure_event_partitions below): retention drops a whole day at once.
-- A finish moves its rows from the first part to the second (one UPDATE, as before).
-- events_finished_default catches a row whose day has no partition; the next
-- ensure_event_partitions moves it to its day. Query `events` as one table: ids are unique
-- (one identity sequence) and every column is here.
-- The dedup key is not here (a UNIQUE constraint across partitions is impossible, and the key
-- must outlive its event's partition): see event_keys.
--   status: pending  -> running (worker claim) | dead (worker claim, attempts exhausted)
--           running  -> done | pending (worker finish; or takeover after a lost partition)
--           done     terminal (finished_at set)
--           dead     -> pending only by an operator (`vigil dead retry`)
CREATE TABLE events (
    id              bigint GENERATED ALWAYS AS IDENTITY,
    user_id         text        NOT NULL,                 -- whose agent this wakes
    source          text        NOT NULL,                 -- github, stripe, chat, timer, approval, a producer's name
    source_id       text        NOT NULL,                 -- the source's own id: dedup key within (user, source), see event_keys
    kind            text        NOT NULL,                 -- what happened (chat.message, github.push, timer.schedule, ...)
    payload         text        NOT NULL DEFAULT '{}',    -- event body as JSON text, as received
    session_id      text,                                 -- resume this saved session (approval answers, replies)
    headers         jsonb       NOT NULL DEFAULT '{}',    -- trace context and other metadata
    occurred_at     timestamptz,                          -- when it happened at the source, if known
    received_at     timestamptz NOT NULL,                 -- when ingest or the producer received it
    recorded_at     timestamptz NOT NULL DEFAULT now(),   -- when the worker recorded it (starts the batch window)
    status          text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,       -- counted at claim: a crashed worker records nothing
    transient_failures integer NOT NULL DEFAULT 0,    -- model API overloads: released without counting an attempt
    claim_epoch     bigint,                               -- partition epoch of the claim that holds/held it
    claimed_at      timestamptz,                          -- when the latest claim was made
    next_attempt_at timestamptz,                          -- backoff: not claimable before this
    finished_at     timestamptz,                          -- set exactly when done or dead
    error           text,                                 -- why the latest attempt failed, or why it is dead
    run_id          bigint,                               -- the run that finished it
    retried_by      text,                                 -- operator who sent it back from dead
    retried_at      timestamptz,                          -- and when
    kafka_topic     text,                                 -- Kafka coordinates of the first copy, for audit
    kafka_partition integer,
    kafka_offset    bigint,
    lost_claims     integer     NOT NULL DEFAULT 0,       -- claims lost with their worker (crash, freeze): see claim rule 3
    CONSTRAINT events_status_valid CHECK (status IN ('pending', 'running', 'done', 'dead')),
    CONSTRAINT events_finished_iff_terminal CHECK ((status IN ('done', 'dead')) = (finished_at IS NOT NULL)),
    CONSTRAINT events_running_has_epoch CHECK (status <> 'running' OR claim_epoch IS NOT NULL),
    CONSTRAINT events_attempts_nonnegative CHECK (attempts >= 0)
) PARTITION BY LIST (status);
CREATE TABLE events_live PARTITION OF events (
    CONSTRAINT events_live_pkey PRIMARY KEY (id)
) FOR VALUES IN ('pending', 'running');
-- The claim reads a user's pending rows in id order; the scan reads users with pending rows.
CREATE INDEX events_pending_by_user ON events_live (user_id, id) WHERE status = 'pending';
-- Claim rule 4 (no second run for a user) and the takeover's hand-back read running rows.
CREATE INDEX events_running_by_user ON events_live (user_id) WHERE status = 'running';
-- Claim rule 2 finds exhausted rows among the retries only (a handful, whatever the backlog).
CREATE INDEX events_retries ON events_live (user_id) WHERE status = 'pending' AND attempts > 0;
-- A queue table: vacuumed after a few thousand dead rows, whatever its size (the claim walks
-- the partial indexes, which keep dead entries until VACUUM; see migration 0009).
ALTER TABLE events_live SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE events_finished PARTITION OF events (
    finished_at NOT NULL,
    CONSTRAINT events_finished_pkey PRIMARY KEY (id, finished_at)
) FOR VALUES IN ('done', 'dead') PARTITION BY RANGE (finished_at);
CREATE INDEX events_dead ON events_finished (finished_at) WHERE status = 'dead';
-- A user's finished events newest first (`vigil inbox`, the demo's look-up by key). Not on
-- the live queue: its partial indexes serve those, and every record and claim would pay an
-- entry here.
CREATE INDEX events_finished_by_user ON events_finished (user_id, id);
CREATE TABLE events_finished_default PARTITION OF events_finished DEFAULT;

-- event_keys: the dedup key of every event recorded in the last VIGIL_DEDUP_WINDOW_DAYS. The
-- second copy of a retried webhook, a redelivered Kafka message, a replayed timer occurrence
-- is rejected by this primary key and nothing else, also after its event's partition was
-- dropped. Narrow on purpose: the worker writes one per event; the scheduler's retention
-- deletes keys older than the window.
CREATE TABLE event_keys (
    user_id     text        NOT NULL,
    source      text        NOT NULL,
    source_id   text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),   -- the key lives the dedup window from here
    CONSTRAINT event_keys_pkey PRIMARY KEY (user_id, source, source_id)
);
-- Keys are written in time order: a BRIN index finds the expired ones for almost no upkeep.
CREATE INDEX event_keys_expiry ON event_keys USING brin (recorded_at);

-- The day partitions of events_finished from yesterday to `ahead` days after today (UTC),
-- plus the days in `days` and those of rows waiting in events_finished_default (which move
-- to their day). Serialised by an advisory lock: any number of schedulers may call it at
-- once. Returns how many partitions it made.
CREATE FUNCTION ensure_event_partitions(ahead integer, days date[] DEFAULT '{}') RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    day date;
    part text;
    lo timestamptz;
    hi timestamptz;
    made integer := 0;
BEGIN
    -- "vigil-pa" in ASCII: one key for every process that makes partitions.
    PERFORM pg_advisory_xact_lock(8532478223426281825);
    FOR day IN
        SELECT d::date FROM generate_series(today - 1, today + ahead, interval '1 day') AS d
        UNION SELECT unnest(days)
        UNION SELECT DISTINCT (finished_at AT TIME ZONE 'UTC')::date FROM events_finished_default
        ORDER BY 1
    LOOP
        part := 'events_finished_p' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_class WHERE relname = part AND relnamespace = current_schema()::regnamespace);
        lo := day::timestamp AT TIME ZONE 'UTC';
        hi := (day + 1)::timestamp AT TIME ZONE 'UTC';
        IF EXISTS (SELECT 1 FROM events_finished_default WHERE finished_at >= lo AND finished_at < hi) THEN
            -- Rows of this day wait in the default partition: the day is built beside it and
            -- attached once they moved (a partition cannot be made over rows the default holds).
            EXECUTE format('CREATE TABLE %I (LIKE events_finished INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
            EXECUTE format('INSERT INTO %I SELECT * FROM events_finished_default WHERE finished_at >= %L AND finished_at < %L',
                           part, lo, hi);
            DELETE FROM events_finished_default WHERE finished_at >= lo AND finished_at < hi;
            EXECUTE format('ALTER TABLE events_finished ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
        ELSE
            EXECUTE format('CREATE TABLE %I PARTITION OF events_finished FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
        END IF;
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$;

-- A partition for every day the old table finished events on, then its rows, ids kept.
SELECT ensure_event_partitions(3, ARRAY(SELECT DISTINCT (finished_at AT TIME ZONE 'UTC')::date FROM events_unpartitioned
                                        WHERE finished_at IS NOT NULL));
INSERT INTO events
    (id, user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at, recorded_at, status,
     attempts, transient_failures, claim_epoch, claimed_at, next_attempt_at, finished_at, error, run_id, retried_by,
     retried_at, kafka_topic, kafka_partition, kafka_offset, lost_claims)
OVERRIDING SYSTEM VALUE
SELECT id, user_id, source, source_id, kind, payload, session_id, headers, occurred_at, received_at, recorded_at, status,
       attempts, transient_failures, claim_epoch, claimed_at, next_attempt_at, finished_at, error, run_id, retried_by,
       retried_at, kafka_topic, kafka_partition, kafka_offset, lost_claims
FROM events_unpartitioned ORDER BY id;
INSERT INTO event_keys (user_id, source, source_id, recorded_at)
SELECT user_id, source, source_id, recorded_at FROM events_unpartitioned ORDER BY id;
SELECT setval(pg_get_serial_sequence('events', 'id'), coalesce(max(id), 0) + 1, false) FROM events_unpartitioned;
DROP TABLE events_unpartitioned;
ANALYZE events;
ANALYZE event_keys;
