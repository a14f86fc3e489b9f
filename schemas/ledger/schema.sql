-- The vigil ledger: the canonical schema.
--
-- This is the source of truth for what the ledger looks like today. A fresh database may be
-- built from this file alone; an existing one is brought here by schemas/ledger/migrations/
-- in order. tests/test_migrations.py builds one database each way and requires that they
-- match, so any change here needs a migration and vice versa.
--
-- Table and column names are an interface for operators and their tooling: add columns
-- freely, never rename the ones docs/architecture.md lists (the services table in "The shape of
-- the system", and "The rules, and where each one lives").
--
-- States are CHECK constraints mirrored by Python enums in services/vigil/ledger/states.py
-- (tests/test_states.py keeps them in step). Next to each state: who moves rows out of it.

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
-- History tables (this one, each day of events_finished, event_keys, runs) only grow until
-- retention drops or deletes them: analyzed after a million changes, not after a tenth of the
-- rows, which a young table or a new day's partition passed at every autovacuum round
-- (migration 0024).
ALTER TABLE events_finished_default SET (autovacuum_analyze_threshold = 1000000);

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
ALTER TABLE event_keys SET (autovacuum_analyze_threshold = 1000000);  -- history (migration 0024)
-- The operator console's search by source id without its user (migration 0021): the key names
-- the user, whose events are then read through their indexes. Here and not on events: this
-- table is insert-only, events rows are rewritten by every claim and finish.
CREATE INDEX event_keys_by_source_id ON event_keys (source_id);

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
        -- History: analyzed after a million changes, not a tenth of the rows (migration 0024).
        EXECUTE format('ALTER TABLE %I SET (autovacuum_analyze_threshold = 1000000)', part);
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$;
SELECT ensure_event_partitions(3);

-- partitions: the fencing token of each topic partition. A worker that is assigned a
-- partition increments epoch; claims and finishes lock this row FOR SHARE and compare.
CREATE TABLE partitions (
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    epoch       bigint  NOT NULL DEFAULT 0,   -- incremented at every assignment (takeover)
    holder      text,                         -- worker id of the latest assignee (informational only)
    acquired_at timestamptz,                  -- when the latest assignment happened
    -- a revoking owner's runs of the partition may finish until then; the next takeover waits
    -- for it (NULL: none in progress; 0023)
    handover_until timestamptz,
    PRIMARY KEY (topic, partition)
);

-- consumer_positions: the next offset of each topic partition that the ledger has recorded
-- everything before, written in the same transaction as the events it covers. On assignment
-- the worker resumes here, not at the group's committed offset: a ledger that lost its last
-- commits (a crash with asynchronous commit, a failover to an asynchronous replica, a restored
-- backup) re-reads those events, and the dedup key drops what it still has. A narrow table of
-- its own: the partitions row is locked FOR SHARE by every claim and finish.
CREATE TABLE consumer_positions (
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    next_offset bigint      NOT NULL,                     -- only ever grows (GREATEST on upsert)
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);

-- users: one row per user seen.
CREATE TABLE users (
    user_id           text PRIMARY KEY,
    home_topic        text        NOT NULL,               -- topic of the first event seen
    home_partition    integer     NOT NULL,               -- its partition: only this partition's owner claims
    first_seen_at     timestamptz NOT NULL DEFAULT now(),
    last_delivery_at  timestamptz,                        -- dispatcher pacing: the latest delivery
    urgent_day        date,                               -- dispatcher: the day urgent_count counts
    urgent_count      integer     NOT NULL DEFAULT 0,     -- urgent deliveries on urgent_day (operator cap)
    -- Attention earned (0031; docs/agent.md "Attention"): the dispatcher adapts the gap at each
    -- new delivery; NULL until the first one (VIGIL_OUTBOX_GAP applies); a channel's gap_seconds wins.
    attention_gap_s      integer,                         -- the user's earned gap
    attention_reason     text,                            -- why it has its value (shown by `vigil users show`)
    attention_at         timestamptz,                     -- when it last changed
    attention_pinned     boolean     NOT NULL DEFAULT false,  -- set by an operator: no adapting
    delivery_day         date,                            -- the day delivery_day_count counts
    delivery_day_count   integer     NOT NULL DEFAULT 0,  -- new deliveries on delivery_day (metrics)
    CONSTRAINT users_attention_gap_nonnegative CHECK (attention_gap_s IS NULL OR attention_gap_s >= 0)
);
CREATE INDEX users_home ON users (home_topic, home_partition);

-- runs: audit of every finished run (written in the run's fenced finish).
--   outcome: message (sent something) | nothing (quiet) | deferred (waiting for approval)
--            | failed (the agent failed; its events went back to pending with a backoff)
CREATE TABLE runs (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id            text        NOT NULL,
    topic              text        NOT NULL,             -- the home partition it ran under
    partition          integer     NOT NULL,
    epoch              bigint      NOT NULL,             -- the fencing epoch of its claim
    worker             text        NOT NULL,             -- worker id that ran it
    event_ids          bigint[]    NOT NULL,             -- every event the run consumed
    session_id         text,                             -- the session it ran in
    started_at         timestamptz NOT NULL,
    finished_at        timestamptz NOT NULL,
    outcome            text        NOT NULL,
    error              text,                             -- for failed runs
    turns              integer     NOT NULL DEFAULT 0,   -- model calls made
    input_tokens       integer     NOT NULL DEFAULT 0,
    output_tokens      integer     NOT NULL DEFAULT 0,
    cache_read_tokens  integer     NOT NULL DEFAULT 0,
    cache_write_tokens integer     NOT NULL DEFAULT 0,
    tool_calls         integer     NOT NULL DEFAULT 0,   -- tool calls the model made (migration 0021)
    task_turns         integer     NOT NULL DEFAULT 0,   -- its background tasks' usage, added as each ends (0030)
    task_input_tokens  integer     NOT NULL DEFAULT 0,
    task_output_tokens integer     NOT NULL DEFAULT 0,
    profile            text,                             -- the agent profile it ran with; NULL: the default (0034)
    profile_version    integer,
    CONSTRAINT runs_outcome_valid CHECK (outcome IN ('message', 'nothing', 'deferred', 'failed')),
    CONSTRAINT runs_finished_after_start CHECK (finished_at >= started_at)
);
CREATE INDEX runs_by_user ON runs (user_id, started_at);
-- The operator console's runs/s: a range scan over the last minutes (migration 0015).
CREATE INDEX runs_by_finish ON runs (finished_at);
ALTER TABLE runs SET (autovacuum_analyze_threshold = 1000000);  -- history (migration 0024)

-- outbox: messages a run decided to send, written in its fenced finish.
--   status: pending   -> sending (dispatcher fixes delivery_id before the send)
--           sending   -> delivered | pending (retry with backoff) | dead (dispatcher);
--                        -> sending again once next_attempt_at passes (its dispatcher died
--                           mid-send: another re-sends under the same delivery_id)
--           delivered terminal; dead -> pending only by an operator
-- Rows sent together share one delivery_id and move together (every update is by delivery_id).
CREATE TABLE outbox (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id         text        NOT NULL,
    run_id          bigint      NOT NULL,                        -- the run that wrote it (no foreign key: 0022)
    epoch           bigint      NOT NULL,                        -- the fencing epoch it was written under
    body            text        NOT NULL,                        -- the message text
    urgent          boolean     NOT NULL DEFAULT false,          -- bypasses the pacing gap
    created_at      timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending',
    delivery_id     uuid,                                        -- idempotency key of its delivery, fixed before sending
    attempts        integer     NOT NULL DEFAULT 0,              -- delivery attempts
    next_attempt_at timestamptz,                                 -- pending: backoff; sending: the send's lease
    delivered_at    timestamptz,
    error           text,                                        -- latest delivery error
    fixed_at        timestamptz,                                 -- when delivery_id was fixed: the delivery's own time
    channel         text,                                        -- channel of the latest attempt: webhook | kafka | log
    dead_at         timestamptz,                                 -- when the dispatcher gave up on it
    session_id      text,                                        -- the conversation that wrote it: a reply resumes it
    deadline        timestamptz,                                 -- worthless after this (an approval question): never held by the urgent cap
    traceparent     text,                                        -- the writing run's W3C trace context (traces on): the delivery continues it
    actions         jsonb,                                       -- an approval question's answer actions (signed URLs; 0032)
    CONSTRAINT outbox_status_valid CHECK (status IN ('pending', 'sending', 'delivered', 'dead')),
    CONSTRAINT outbox_delivered_has_time CHECK ((status = 'delivered') = (delivered_at IS NOT NULL)),
    CONSTRAINT outbox_sending_has_delivery CHECK (status <> 'sending' OR delivery_id IS NOT NULL),
    CONSTRAINT outbox_fixed_with_delivery CHECK ((delivery_id IS NULL) = (fixed_at IS NULL)),
    CONSTRAINT outbox_dead_has_time CHECK ((status = 'dead') = (dead_at IS NOT NULL)),
    CONSTRAINT outbox_channel_valid CHECK (channel IS NULL OR channel IN ('webhook', 'kafka', 'log'))
);
CREATE INDEX outbox_undelivered ON outbox (user_id, id) WHERE status IN ('pending', 'sending');
-- The dispatcher finishes a delivery by its id; operators list dead deliveries newest first.
CREATE INDEX outbox_by_delivery ON outbox (delivery_id) WHERE delivery_id IS NOT NULL;
CREATE INDEX outbox_dead ON outbox (dead_at) WHERE status = 'dead';
-- Retention deletes old runs: the foreign key's check and the prune find their outbox rows here.
CREATE INDEX outbox_by_run ON outbox (run_id);
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE outbox SET (autovacuum_analyze_threshold = 1000000);  -- migration 0025
-- Past messages for the agent's context come from delivered rows.
CREATE INDEX outbox_delivered_by_user ON outbox (user_id, delivered_at) WHERE status = 'delivered';

-- timers: follow-ups (one-off), schedules (interval or cron) and approval expiries.
-- The scheduler moves rows: due advances, or done/skipped become true. DELETE through the
-- API or `vigil timers rm` sets done with cancelled_at; re-registering the id revives it.
CREATE TABLE timers (
    id             text        NOT NULL,                  -- caller's id, unique per user
    user_id        text        NOT NULL,
    kind           text        NOT NULL,                  -- followup | schedule | approval_expiry
    due            timestamptz NOT NULL,                  -- next occurrence, whole seconds
    every_seconds  integer,                               -- fixed interval recurrence
    cron           text,                                  -- 5-field cron recurrence, evaluated in tz
    tz             text        NOT NULL DEFAULT 'UTC',    -- IANA zone for cron
    catch_up       text        NOT NULL DEFAULT 'coalesce', -- coalesce | each | skip
    max_lateness   integer,                               -- seconds: an older occurrence is skipped
    payload        jsonb       NOT NULL DEFAULT '{}',     -- copied into every event it fires
    fixed_key      text,                                  -- one-offs: the event's source_id instead of id@due
    done           boolean     NOT NULL DEFAULT false,    -- one-off fired (or skipped), or deleted schedule
    skipped        boolean     NOT NULL DEFAULT false,    -- one-off missed and skipped by policy
    fired_count    integer     NOT NULL DEFAULT 0,
    last_fired_at  timestamptz,
    -- Every occurrence at or before this instant was fired or passed over: a re-registration
    -- (a deploy re-running its set-up with an old due) never fires them a second time.
    handled_through timestamptz,
    cancelled_at   timestamptz,                           -- set by DELETE / `vigil timers rm` (done too)
    run_id         bigint,                                -- the run whose finish last set it; NULL: the API (0021)
    error          text,                                  -- why the scheduler gave up on a row it could not plan (done too)
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    traceparent    text,                                  -- the setting run's W3C trace context (traces on): the fire span continues it
    token_id       text,                                  -- the API token that created or last registered it; NULL: a run or the CLI (0027)
    PRIMARY KEY (user_id, id),
    CONSTRAINT timers_kind_valid CHECK (kind IN ('followup', 'schedule', 'approval_expiry')),
    CONSTRAINT timers_catch_up_valid CHECK (catch_up IN ('coalesce', 'each', 'skip')),
    CONSTRAINT timers_one_recurrence CHECK (NOT (every_seconds IS NOT NULL AND cron IS NOT NULL)),
    CONSTRAINT timers_interval_positive CHECK (every_seconds IS NULL OR every_seconds > 0),
    CONSTRAINT timers_fixed_key_one_off CHECK (fixed_key IS NULL OR (every_seconds IS NULL AND cron IS NULL)),
    CONSTRAINT timers_due_whole_seconds CHECK (due = date_trunc('second', due)),
    CONSTRAINT timers_cancelled_is_done CHECK (cancelled_at IS NULL OR done),
    CONSTRAINT timers_error_is_done CHECK (error IS NULL OR done)
);
CREATE INDEX timers_due ON timers (due) WHERE NOT done;
-- VIGIL_TIMER_QUOTA_PER_TOKEN's count (0027).
CREATE INDEX timers_live_by_token ON timers (token_id) WHERE NOT done AND token_id IS NOT NULL;

-- approvals: deferred tool calls. The answer and the expiry share the key request_id:
-- whichever is stored first stands (answer IS NULL is the only state that moves).
CREATE TABLE approvals (
    request_id   text PRIMARY KEY,
    user_id      text        NOT NULL,
    session_id   text        NOT NULL,                    -- the saved session to resume
    run_id       bigint,                                  -- the run that asked
    tool         text        NOT NULL,
    tool_use_id  text,                                    -- the model's tool_use block id
    args_hash    text        NOT NULL,                    -- sha256 of the exact arguments
    due          timestamptz NOT NULL,                    -- the deadline
    on_expiry    text        NOT NULL DEFAULT 'deny',     -- deny | escalate | approve
    escalations  integer     NOT NULL DEFAULT 0,          -- times asked again, louder
    answer       text,                                    -- yes | no | expired; NULL while open
    answered_at  timestamptz,                             -- when the answer was stored
    received_at  timestamptz,                             -- when the answer request was received
    created_at   timestamptz NOT NULL DEFAULT now(),
    answered_via text,                                    -- api | chat | action | operator; NULL: the expiry's, or open (0032)
    CONSTRAINT approvals_on_expiry_valid CHECK (on_expiry IN ('deny', 'escalate', 'approve')),
    CONSTRAINT approvals_answer_valid CHECK (answer IS NULL OR answer IN ('yes', 'no', 'expired')),
    CONSTRAINT approvals_answered_has_time CHECK ((answer IS NULL) = (answered_at IS NULL)),
    CONSTRAINT approvals_answered_via_valid CHECK (answered_via IS NULL OR answered_via IN ('api', 'chat', 'action', 'operator'))
);
CREATE INDEX approvals_by_user ON approvals (user_id, created_at);
-- The operator console lists open requests by deadline (migration 0015).
CREATE INDEX approvals_open_by_due ON approvals (due, request_id) WHERE answer IS NULL;

-- sessions: saved agent conversations.
--   state: open (resumable) | waiting (mid tool call, for an approval) | closed (over budget or ended)
--   Only the worker's finish moves them, as the agent decided: open -> waiting (a call needs approval)
--   or closed (past the size budget); waiting -> open (the answer or expiry resumed it).
CREATE TABLE sessions (
    id          text PRIMARY KEY,
    user_id     text        NOT NULL,
    state       text        NOT NULL DEFAULT 'open',
    messages    jsonb       NOT NULL DEFAULT '[]',        -- the Messages API conversation so far
    size_bytes  integer     NOT NULL DEFAULT 0,           -- against the session size budget
    blocks      integer     NOT NULL DEFAULT 0,           -- auto-mode permission blocks in this session
    consecutive_blocks integer NOT NULL DEFAULT 0,        -- ... since the last auto-mode call that passed
    pending     jsonb,                                    -- while waiting: the deferred call (tool, input, request_id, ...)
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT sessions_state_valid CHECK (state IN ('open', 'waiting', 'closed')),
    CONSTRAINT sessions_waiting_has_pending CHECK ((state = 'waiting') = (pending IS NOT NULL))
);
CREATE INDEX sessions_by_user ON sessions (user_id, updated_at);

-- agent_policies: per-user overrides of deployment-wide agent settings, set by operators
-- (`vigil policies set`). event_policies has VIGIL_EVENT_POLICIES's syntax and wins over it
-- source by source: what an event arriving mid-run does (queue | fold | interrupt).
CREATE TABLE agent_policies (
    user_id        text PRIMARY KEY,
    event_policies text        NOT NULL DEFAULT '',
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- profiles: agent profiles (model, system prompt, limits, tools, MCP servers, event policies,
-- budgets) as a JSON spec, one row per version, never changed: an update adds the next
-- version (`vigil profiles`, docs/agent.md "Profiles"). profile_assignments gives users a
-- profile by exact id or prefix pattern (`team-a/*`); the most specific wins (migration 0034).
CREATE TABLE profiles (
    name        text        NOT NULL,
    version     integer     NOT NULL,
    spec        jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    created_by  text        NOT NULL,
    PRIMARY KEY (name, version),
    CONSTRAINT profiles_name_valid CHECK (name ~ '^[a-z][a-z0-9_-]{0,63}$' AND name <> 'default'),
    CONSTRAINT profiles_version_valid CHECK (version >= 1)
);
CREATE TABLE profile_assignments (
    pattern     text        PRIMARY KEY,                  -- a user id, or a prefix ending in '*'
    profile     text        NOT NULL,
    assigned_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT profile_assignments_pattern_valid CHECK (strpos(pattern, '*') IN (0, length(pattern)))
);

-- budget_notices: the one notice per user and UTC day that their daily token budget is spent
-- (docs/agent.md, "Budgets"); its outbox row is written by the same statement.
CREATE TABLE budget_notices (
    user_id     text        NOT NULL,
    day         date        NOT NULL,
    profile     text        NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, day)
);

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
--   mode sync (0035): a sub-agent run inside its parent's run, recorded best effort by that run:
--           running (as it starts) -> succeeded | failed (as it ends, reported_at set: no event)
--                                  -> lost (reaper: its run ended past the deadline without a word)
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
    run_id              bigint,                              -- the run whose finish queued it (a task's background child: that task's); NULL: a sync child (0021, 0035)
    reported_at         timestamptz,                         -- its result event was acknowledged by the broker
    last_tool           text,                                -- progress (0030): the last tool the child called
    note                text,                                -- its latest note: the text it wrote with that call
    progress_at         timestamptz,                         -- when the holder's heartbeat last flushed progress
    mode                text        NOT NULL DEFAULT 'background', -- sync: a sub-agent run inside its parent's run (0035)
    kind                text        NOT NULL DEFAULT 'delegated', -- or memory_review, queued by the scheduler (0036)
    profile             text,                                -- the delegating run's profile, which the task runs with; NULL: the default (0037)
    profile_version     integer,
    CONSTRAINT tasks_status_valid
        CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'timed_out', 'lost')),
    CONSTRAINT tasks_finished_iff_terminal
        CHECK ((status IN ('succeeded', 'failed', 'cancelled', 'timed_out', 'lost')) = (finished_at IS NOT NULL)),
    CONSTRAINT tasks_mode_valid CHECK (mode IN ('background', 'sync')),
    -- A sync row holds no lease: its run's claim is its lease (0035).
    CONSTRAINT tasks_running_has_lease
        CHECK (status <> 'running' OR mode = 'sync' OR (lease_holder IS NOT NULL AND heartbeat_at IS NOT NULL)),
    CONSTRAINT tasks_depth_positive CHECK (depth >= 1),
    CONSTRAINT tasks_reported_after_finish CHECK (reported_at IS NULL OR finished_at IS NOT NULL),
    CONSTRAINT tasks_kind_valid CHECK (kind IN ('delegated', 'memory_review'))
);
-- The claim takes the oldest queued tasks; the reaper reads running ones by heartbeat age.
CREATE INDEX tasks_queued ON tasks (created_at) WHERE status = 'queued';
CREATE INDEX tasks_running ON tasks (heartbeat_at) WHERE status = 'running';
-- Terminal tasks whose result event has not been produced yet (a handful at any time).
CREATE INDEX tasks_unreported ON tasks (finished_at) WHERE finished_at IS NOT NULL AND reported_at IS NULL;
CREATE INDEX tasks_by_user ON tasks (user_id, created_at);
-- A task's children, for its tree (vigil tasks show; 0035).
CREATE INDEX tasks_by_parent_task ON tasks (parent_task_id) WHERE parent_task_id IS NOT NULL;
-- One open memory review per user (docs/agent.md, "Dreaming"): two schedulers racing insert one.
CREATE UNIQUE INDEX tasks_one_open_review ON tasks (user_id)
    WHERE kind = 'memory_review' AND status IN ('queued', 'running');
CREATE INDEX tasks_reviews ON tasks (user_id, created_at) WHERE kind = 'memory_review';

-- run_journal: every step of a run in flight, appended as it happens (migration 0026), so a
-- run claimed again after a crash, a deploy's stop or a rebalance replays what it did instead
-- of doing it again (docs/worker.md, "Durable runs"). Written by the worker only.
--   run_key: the run's identity, the same across attempts, epochs and workers until its events
--            finish: "<user>:<first event id>" (a background task: "task:<task id>"); tool
--            idempotency keys are "<run_key>:<step>".
--   step:    the step's position in the run, from 1 (model turns and tool calls, in order;
--            a sync sub-agent's steps are the run's).
--   kind:    model (body: the answer's content blocks, usage, duration; the first one also the
--            run's start: its events, its "now" and its system prompt)
--            | call (an action tool call's intent: name, input, key; outcome: its result,
--            NULL while in doubt)
--   epoch:   the claim's epoch (a task's lease epoch) under which the step was appended: every
--            append and outcome is fenced by it, so a stale worker's late step is refused.
--   body, outcome: json, not jsonb: replay hands the model the same bytes it saw.
--   finished_at: set by the run's finish when VIGIL_RUN_JOURNAL_DAYS > 0 (kept for operators,
--            then pruned); with the default 0 the finish deletes the run's rows.
--   alone_at: on step 1, when the run's batch was replayed alone on its lead's last attempt
--            (migration 0040; docs/worker.md, "Claiming"): a journal so stamped that comes back
--            to a last attempt crashed by itself, and its first event runs alone afresh.
CREATE TABLE run_journal (
    run_key     text        NOT NULL,
    step        integer     NOT NULL,
    kind        text        NOT NULL,
    user_id     text        NOT NULL,
    epoch       bigint      NOT NULL,
    attempt     integer     NOT NULL,                -- the claim's attempt that appended it
    body        json        NOT NULL,
    outcome     json,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    outcome_at  timestamptz,
    finished_at timestamptz,
    alone_at    timestamptz,
    -- the run's first event: the run key's id (<user>:<id>[~<attempt>]); NULL for a task's (0043)
    lead_event  bigint GENERATED ALWAYS AS (substring(run_key FROM ':([0-9]+)(~[^:]*)?$')::bigint) STORED,
    PRIMARY KEY (run_key, step),
    CONSTRAINT run_journal_kind_valid CHECK (kind IN ('model', 'call')),
    CONSTRAINT run_journal_step_positive CHECK (step >= 1),
    CONSTRAINT run_journal_outcome_of_call CHECK (outcome IS NULL OR kind = 'call')
);
-- A run's start reads the live journal of its user (one run per user at a time).
CREATE INDEX run_journal_live ON run_journal (user_id, run_key) WHERE finished_at IS NULL;
-- Retention of the kept journals (VIGIL_RUN_JOURNAL_DAYS).
CREATE INDEX run_journal_finished ON run_journal (finished_at) WHERE finished_at IS NOT NULL;

-- run_replays: one row per what-if replay (`vigil runs replay`, migration 0041; docs/agent.md,
-- "Changing an agent safely"), written by that command only, read by the console's run page.
--   run_key:  the kept run replayed (its journal's key, "<user>:<first event id>[~<attempt>]").
--   ran_with: what the replay ran with (profile, version, model).
--   verdict:  same actions | different actions | new actions (a call the recorded run did not
--             make, not executed); messages_changed: the user would have received other messages.
--   report:   both runs side by side, as `vigil runs replay --json` prints them.
CREATE TABLE run_replays (
    id               bigserial   PRIMARY KEY,
    run_key          text        NOT NULL,
    user_id          text        NOT NULL,
    made_at          timestamptz NOT NULL DEFAULT now(),
    made_by          text        NOT NULL,
    ran_with         text        NOT NULL,
    verdict          text        NOT NULL,
    messages_changed boolean     NOT NULL,
    report           json        NOT NULL,
    CONSTRAINT run_replays_verdict_valid CHECK (verdict IN ('same actions', 'different actions', 'new actions'))
);
CREATE INDEX run_replays_of_run ON run_replays (user_id, run_key);

-- run_upgrades: in-flight runs an operator moved to a newer version of their profile (`vigil
-- runs upgrade`, migration 0042; docs/agent.md, "Changing an agent safely"), one row per run
-- moved, written by that command only (with an `audit` row per shard: who, when, how many).
-- A replay of the run (a crash, a hand-over, a takeover) reads its latest row and goes on under
-- `to_version`: its journaled steps stay facts, what it has not done yet runs on the new version.
--   run_key:      the live journal's key ("<user>:<first event id>[~<attempt>]").
--   from_version: the version the run had (its journal's start, or an earlier upgrade).
CREATE TABLE run_upgrades (
    id           bigserial   PRIMARY KEY,
    run_key      text        NOT NULL,
    user_id      text        NOT NULL,
    profile      text        NOT NULL,
    from_version integer     NOT NULL,
    to_version   integer     NOT NULL,
    made_at      timestamptz NOT NULL DEFAULT now(),
    made_by      text        NOT NULL,
    CONSTRAINT run_upgrades_newer CHECK (to_version > from_version)
);
CREATE INDEX run_upgrades_of_run ON run_upgrades (run_key, to_version);

-- model_slots: the fleet-wide bound on concurrent model calls (VIGIL_MODEL_FLEET_CONCURRENCY
-- rows, made and trimmed by the workers at start). A call takes a free slot (lease_until in
-- the past) for at most the model timeout and a margin, and gives it back when it ends; a
-- dead worker's slot frees itself when its lease ends.
CREATE TABLE model_slots (
    slot        integer     PRIMARY KEY,
    holder      text,                                    -- worker instance and call, for operators
    lease_until timestamptz NOT NULL DEFAULT '-infinity',
    CONSTRAINT model_slots_slot_valid CHECK (slot >= 0)
);

-- model_backoff: the shared back-off toward the model provider. A 429 or 529 moves ``until``
-- forward (never back); every worker waits for it before its next call.
CREATE TABLE model_backoff (
    provider    text        PRIMARY KEY,                 -- 'anthropic'
    until       timestamptz NOT NULL,
    reason      text        NOT NULL,                    -- rate_limited | overloaded
    set_by      text        NOT NULL,                    -- the worker instance that was told
    set_at      timestamptz NOT NULL
);

-- memory: the agent's files under /memories, per user (the memory tool's store).
CREATE TABLE memory (
    user_id     text        NOT NULL,
    path        text        NOT NULL,                     -- always under /memories/, never with ..
    content     text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    run_id      bigint,                                   -- the run whose finish last wrote it (0021)
    PRIMARY KEY (user_id, path),
    CONSTRAINT memory_path_confined CHECK (path LIKE '/memories/%' AND path NOT LIKE '%..%')
);

-- memory_history: every change of a memory file, by a run's finish, a memory review or an
-- operator's revert, with the old and new content (0036): `vigil memory history` lists them,
-- `vigil memory revert` undoes one (docs/agent.md, "Dreaming").
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

-- refunds: the demo `refund` tool's record, standing in for a payment provider that honours
-- idempotency keys: one refund per key (the approval's request id), however often it is called.
CREATE TABLE refunds (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key  text          NOT NULL UNIQUE,
    user_id          text          NOT NULL,
    order_id         text          NOT NULL,
    amount           numeric(12,2) NOT NULL,
    reason           text,
    created_at       timestamptz   NOT NULL DEFAULT now(),
    CONSTRAINT refunds_amount_positive CHECK (amount > 0)
);

-- api_tokens: bearer tokens for the HTTP API (sha256 of the token; the token is shown once).
CREATE TABLE api_tokens (
    id          text PRIMARY KEY,
    name        text        NOT NULL,
    token_hash  text        NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,                              -- a revoked token is refused with 403
    scopes      text[],                                   -- route families it may use; NULL: all (tokens from before 0013)
    users       text[],                                   -- users it may act for (`prefix*` for a prefix); NULL: any
    expires_at  timestamptz,                              -- refused from then on (401 token_expired); NULL: never (0028)
    CONSTRAINT api_tokens_scopes_valid
        CHECK (scopes <@ ARRAY['events', 'messages', 'timers', 'approvals', 'admin']::text[])
);

-- console_sessions: a console login (0028). The cookie holds a random id, stored here as its
-- sha256; the session ends at expires_at, or at logout (ended_at), whichever comes first.
CREATE TABLE console_sessions (
    id_hash     text PRIMARY KEY,
    token_id    text        NOT NULL REFERENCES api_tokens (id),
    csrf        text        NOT NULL,                     -- the value its forms send back
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    ended_at    timestamptz,
    CONSTRAINT console_sessions_expire_after_start CHECK (expires_at > created_at)
);
CREATE INDEX console_sessions_by_expiry ON console_sessions (expires_at);

-- hooks: webhook endpoints (POST /v1/hooks/{id}), each for one provider and one user.
CREATE TABLE hooks (
    id          text PRIMARY KEY,
    provider    text        NOT NULL,                     -- github | stripe | standard-webhooks
    user_id     text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    disabled_at timestamptz,
    CONSTRAINT hooks_provider_valid CHECK (provider IN ('github', 'stripe', 'standard-webhooks'))
);

-- hook_secrets: signing secrets of a hook; several active at once during rotation.
CREATE TABLE hook_secrets (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    hook_id     text        NOT NULL REFERENCES hooks (id) ON DELETE CASCADE,
    secret      text        NOT NULL,                     -- sealed with VIGIL_SECRET_KEY (opened to verify HMACs)
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,
    sealed_with text                                      -- id of the sealing key; NULL: in clear (0029)
);
CREATE INDEX hook_secrets_active ON hook_secrets (hook_id) WHERE revoked_at IS NULL;

-- channels: where a user's deliveries go. A user without a row gets the log channel.
CREATE TABLE channels (
    user_id           text PRIMARY KEY,
    type              text        NOT NULL,               -- webhook | kafka | log
    url               text,                               -- webhook target
    secret            text,                               -- webhook signing secret (Standard Webhooks), sealed
    gap_seconds       integer,                            -- pacing gap override (else VIGIL_OUTBOX_GAP)
    urgent_daily_cap  integer,                            -- urgent deliveries allowed per day (NULL: VIGIL_URGENT_DAILY_CAP)
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    sealed_with       text,                               -- id of the key that sealed secret; NULL: in clear
    CONSTRAINT channels_type_valid CHECK (type IN ('webhook', 'kafka', 'log')),
    CONSTRAINT channels_webhook_has_url CHECK (type <> 'webhook' OR (url IS NOT NULL AND secret IS NOT NULL)),
    CONSTRAINT channels_gap_nonnegative CHECK (gap_seconds IS NULL OR gap_seconds >= 0),
    CONSTRAINT channels_urgent_cap_nonnegative CHECK (urgent_daily_cap IS NULL OR urgent_daily_cap >= 0)
);

-- audit: what operators did by hand (dead retry, token revoke, hook changes).
CREATE TABLE audit (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL,                         -- $USER of the operator, or the API token name
    action  text        NOT NULL,
    detail  jsonb       NOT NULL DEFAULT '{}'
);

-- shard_map: which ledger shard holds each Kafka partition of the events topic and its users
-- (docs/architecture.md, "Shards"). Read from the catalog (shard 0); empty on the other shards.
-- A partition without a row follows the rule partition % shards (vigil.ledger.shardmap);
-- `vigil migrate` seeds the configured partitions' rows from it and never rewrites one (0038).
CREATE TABLE shard_map (
    partition   integer     PRIMARY KEY,
    shard       integer     NOT NULL,
    assigned_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT shard_map_partition_valid CHECK (partition >= 0),
    CONSTRAINT shard_map_shard_valid CHECK (shard >= 0)
);

-- shard_moves: moves of partitions between shards, in the catalog (0039; docs/operations.md,
-- "Moving a partition to another shard"). A move spans several shards and no transaction does:
-- this row is what a run of `vigil shards move` reads to carry on where an interrupted one stopped.
--   state: copying -> flipped (the same command: copied, verified, shard_map changed)
--          flipped -> done    (the same command: the source's rows deleted)
--          done    terminal; the partition's next move writes the row again
CREATE TABLE shard_moves (
    partition   integer     PRIMARY KEY,
    source      integer     NOT NULL,                     -- the shard its users leave
    target      integer     NOT NULL,                     -- the shard they go to
    state       text        NOT NULL DEFAULT 'copying',
    started_at  timestamptz NOT NULL DEFAULT now(),
    flipped_at  timestamptz,                              -- shard_map changed: the target holds them
    finished_at timestamptz,                              -- the source's copies deleted
    CONSTRAINT shard_moves_state_valid CHECK (state IN ('copying', 'flipped', 'done')),
    CONSTRAINT shard_moves_two_shards CHECK (source <> target AND source >= 0 AND target >= 0),
    CONSTRAINT shard_moves_flipped_has_time CHECK ((state = 'copying') = (flipped_at IS NULL)),
    CONSTRAINT shard_moves_done_has_time CHECK ((state = 'done') = (finished_at IS NOT NULL))
);
