-- 0014: conversations that continue. Each message remembers the session that wrote it, so a
-- delivery can name it and a person's reply (in_reply_to the delivery) resumes that session
-- instead of starting a new one. An approval question carries its deadline: the dispatcher
-- never holds such a message behind the daily urgent cap, since a question that arrives
-- after its deadline can no longer be answered.
ALTER TABLE outbox ADD COLUMN session_id text;
ALTER TABLE outbox ADD COLUMN deadline timestamptz;

-- Per-user overrides of deployment-wide agent settings (`vigil policies set`): what an
-- event arriving mid-run does, per source, over VIGIL_EVENT_POLICIES.
CREATE TABLE agent_policies (
    user_id        text PRIMARY KEY,
    event_policies text        NOT NULL DEFAULT '',
    updated_at     timestamptz NOT NULL DEFAULT now()
);
