-- 0033: one fleet toward the model. A fleet-wide bound on concurrent model calls (leased
-- slots, VIGIL_MODEL_FLEET_CONCURRENCY) and a shared back-off: when the provider answers 429
-- or 529, the worker that was told writes until when, and every worker waits for it before
-- its next call (docs/agent.md, "One fleet toward the model").
CREATE TABLE model_slots (
    slot        integer     PRIMARY KEY,
    holder      text,
    lease_until timestamptz NOT NULL DEFAULT '-infinity',
    CONSTRAINT model_slots_slot_valid CHECK (slot >= 0)
);
CREATE TABLE model_backoff (
    provider    text        PRIMARY KEY,
    until       timestamptz NOT NULL,
    reason      text        NOT NULL,
    set_by      text        NOT NULL,
    set_at      timestamptz NOT NULL
);
