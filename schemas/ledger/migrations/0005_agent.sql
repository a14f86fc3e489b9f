-- 0005: the Claude agent's state on sessions (the deferred call a waiting session resumes,
-- auto-mode blocks in a row) and the demo refund tool's record.
ALTER TABLE sessions
    ADD COLUMN consecutive_blocks integer NOT NULL DEFAULT 0,
    ADD COLUMN pending jsonb,
    ADD CONSTRAINT sessions_waiting_has_pending CHECK ((state = 'waiting') = (pending IS NOT NULL));

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
