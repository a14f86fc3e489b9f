-- 0001: the ledger as first designed. See schemas/ledger/schema.sql for the canonical form
-- with every table and column described; this file must produce the same schema.

-- events: one row per event. The UNIQUE key is the only dedup mechanism.
CREATE TABLE events (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id         text        NOT NULL,
    source          text        NOT NULL,
    source_id       text        NOT NULL,
    kind            text        NOT NULL,
    payload         text        NOT NULL DEFAULT '{}',
    session_id      text,
    headers         jsonb       NOT NULL DEFAULT '{}',
    occurred_at     timestamptz,
    received_at     timestamptz NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    transient_failures integer NOT NULL DEFAULT 0,
    claim_epoch     bigint,
    claimed_at      timestamptz,
    next_attempt_at timestamptz,
    finished_at     timestamptz,
    error           text,
    run_id          bigint,
    retried_by      text,
    retried_at      timestamptz,
    kafka_topic     text,
    kafka_partition integer,
    kafka_offset    bigint,
    CONSTRAINT events_dedup_key UNIQUE (user_id, source, source_id),
    CONSTRAINT events_status_valid CHECK (status IN ('pending', 'running', 'done', 'dead')),
    CONSTRAINT events_finished_iff_terminal CHECK ((status IN ('done', 'dead')) = (finished_at IS NOT NULL)),
    CONSTRAINT events_running_has_epoch CHECK (status <> 'running' OR claim_epoch IS NOT NULL),
    CONSTRAINT events_attempts_nonnegative CHECK (attempts >= 0)
);
CREATE INDEX events_pending_by_user ON events (user_id, id) WHERE status = 'pending';
CREATE INDEX events_running_by_user ON events (user_id) WHERE status = 'running';
CREATE INDEX events_dead ON events (finished_at) WHERE status = 'dead';

-- partitions: the fencing token of each topic partition.
CREATE TABLE partitions (
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    epoch       bigint  NOT NULL DEFAULT 0,
    holder      text,
    acquired_at timestamptz,
    PRIMARY KEY (topic, partition)
);

-- users: home partition (fixed at first sight) and pacing state.
CREATE TABLE users (
    user_id           text PRIMARY KEY,
    home_topic        text        NOT NULL,
    home_partition    integer     NOT NULL,
    first_seen_at     timestamptz NOT NULL DEFAULT now(),
    last_delivery_at  timestamptz,
    urgent_day        date,
    urgent_count      integer     NOT NULL DEFAULT 0
);
CREATE INDEX users_home ON users (home_topic, home_partition);

-- runs: audit of every finished run.
CREATE TABLE runs (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id            text        NOT NULL,
    topic              text        NOT NULL,
    partition          integer     NOT NULL,
    epoch              bigint      NOT NULL,
    worker             text        NOT NULL,
    event_ids          bigint[]    NOT NULL,
    session_id         text,
    started_at         timestamptz NOT NULL,
    finished_at        timestamptz NOT NULL,
    outcome            text        NOT NULL,
    error              text,
    turns              integer     NOT NULL DEFAULT 0,
    input_tokens       integer     NOT NULL DEFAULT 0,
    output_tokens      integer     NOT NULL DEFAULT 0,
    cache_read_tokens  integer     NOT NULL DEFAULT 0,
    cache_write_tokens integer     NOT NULL DEFAULT 0,
    CONSTRAINT runs_outcome_valid CHECK (outcome IN ('message', 'nothing', 'deferred', 'failed')),
    CONSTRAINT runs_finished_after_start CHECK (finished_at >= started_at)
);
CREATE INDEX runs_by_user ON runs (user_id, started_at);

-- outbox: messages written by a run's finish, relayed by the dispatcher.
CREATE TABLE outbox (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id         text        NOT NULL,
    run_id          bigint      NOT NULL REFERENCES runs (id),
    epoch           bigint      NOT NULL,
    body            text        NOT NULL,
    urgent          boolean     NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now(),
    status          text        NOT NULL DEFAULT 'pending',
    delivery_id     uuid,
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    delivered_at    timestamptz,
    error           text,
    CONSTRAINT outbox_status_valid CHECK (status IN ('pending', 'sending', 'delivered', 'dead')),
    CONSTRAINT outbox_delivered_has_time CHECK ((status = 'delivered') = (delivered_at IS NOT NULL)),
    CONSTRAINT outbox_sending_has_delivery CHECK (status <> 'sending' OR delivery_id IS NOT NULL)
);
CREATE INDEX outbox_undelivered ON outbox (user_id, id) WHERE status IN ('pending', 'sending');
CREATE INDEX outbox_delivered_by_user ON outbox (user_id, delivered_at) WHERE status = 'delivered';

-- timers: follow-ups, schedules and approval expiries.
CREATE TABLE timers (
    id             text        NOT NULL,
    user_id        text        NOT NULL,
    kind           text        NOT NULL,
    due            timestamptz NOT NULL,
    every_seconds  integer,
    cron           text,
    tz             text        NOT NULL DEFAULT 'UTC',
    catch_up       text        NOT NULL DEFAULT 'coalesce',
    max_lateness   integer,
    payload        jsonb       NOT NULL DEFAULT '{}',
    fixed_key      text,
    done           boolean     NOT NULL DEFAULT false,
    skipped        boolean     NOT NULL DEFAULT false,
    fired_count    integer     NOT NULL DEFAULT 0,
    last_fired_at  timestamptz,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, id),
    CONSTRAINT timers_kind_valid CHECK (kind IN ('followup', 'schedule', 'approval_expiry')),
    CONSTRAINT timers_catch_up_valid CHECK (catch_up IN ('coalesce', 'each', 'skip')),
    CONSTRAINT timers_one_recurrence CHECK (NOT (every_seconds IS NOT NULL AND cron IS NOT NULL)),
    CONSTRAINT timers_interval_positive CHECK (every_seconds IS NULL OR every_seconds > 0),
    CONSTRAINT timers_fixed_key_one_off CHECK (fixed_key IS NULL OR (every_seconds IS NULL AND cron IS NULL)),
    CONSTRAINT timers_due_whole_seconds CHECK (due = date_trunc('second', due))
);
CREATE INDEX timers_due ON timers (due) WHERE NOT done;

-- approvals: deferred tool calls waiting for an answer or their deadline.
CREATE TABLE approvals (
    request_id   text PRIMARY KEY,
    user_id      text        NOT NULL,
    session_id   text        NOT NULL,
    run_id       bigint,
    tool         text        NOT NULL,
    tool_use_id  text,
    args_hash    text        NOT NULL,
    due          timestamptz NOT NULL,
    on_expiry    text        NOT NULL DEFAULT 'deny',
    escalations  integer     NOT NULL DEFAULT 0,
    answer       text,
    answered_at  timestamptz,
    received_at  timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT approvals_on_expiry_valid CHECK (on_expiry IN ('deny', 'escalate', 'approve')),
    CONSTRAINT approvals_answer_valid CHECK (answer IS NULL OR answer IN ('yes', 'no', 'expired')),
    CONSTRAINT approvals_answered_has_time CHECK ((answer IS NULL) = (answered_at IS NULL))
);
CREATE INDEX approvals_by_user ON approvals (user_id, created_at);

-- sessions: saved agent conversations, resumed by events carrying their id.
CREATE TABLE sessions (
    id          text PRIMARY KEY,
    user_id     text        NOT NULL,
    state       text        NOT NULL DEFAULT 'open',
    messages    jsonb       NOT NULL DEFAULT '[]',
    size_bytes  integer     NOT NULL DEFAULT 0,
    blocks      integer     NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT sessions_state_valid CHECK (state IN ('open', 'waiting', 'closed'))
);
CREATE INDEX sessions_by_user ON sessions (user_id, updated_at);

-- memory: the agent's per-user files under /memories.
CREATE TABLE memory (
    user_id     text        NOT NULL,
    path        text        NOT NULL,
    content     text        NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, path),
    CONSTRAINT memory_path_confined CHECK (path LIKE '/memories/%' AND path NOT LIKE '%..%')
);

-- api_tokens: bearer tokens for the HTTP API, stored hashed.
CREATE TABLE api_tokens (
    id          text PRIMARY KEY,
    name        text        NOT NULL,
    token_hash  text        NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

-- hooks: webhook endpoints, each bound to one provider and one user.
CREATE TABLE hooks (
    id          text PRIMARY KEY,
    provider    text        NOT NULL,
    user_id     text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    disabled_at timestamptz,
    CONSTRAINT hooks_provider_valid CHECK (provider IN ('github', 'stripe', 'standard-webhooks'))
);

-- hook_secrets: several may be active at once, for rotation.
CREATE TABLE hook_secrets (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    hook_id     text        NOT NULL REFERENCES hooks (id) ON DELETE CASCADE,
    secret      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX hook_secrets_active ON hook_secrets (hook_id) WHERE revoked_at IS NULL;

-- channels: where a user's deliveries go; a user without a row gets the log channel.
CREATE TABLE channels (
    user_id           text PRIMARY KEY,
    type              text        NOT NULL,
    url               text,
    secret            text,
    gap_seconds       integer,
    urgent_daily_cap  integer,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT channels_type_valid CHECK (type IN ('webhook', 'kafka', 'log')),
    CONSTRAINT channels_webhook_has_url CHECK (type <> 'webhook' OR (url IS NOT NULL AND secret IS NOT NULL)),
    CONSTRAINT channels_gap_nonnegative CHECK (gap_seconds IS NULL OR gap_seconds >= 0)
);

-- audit: what operators did by hand (dead retry, token revoke, ...).
CREATE TABLE audit (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL,
    action  text        NOT NULL,
    detail  jsonb       NOT NULL DEFAULT '{}'
);
