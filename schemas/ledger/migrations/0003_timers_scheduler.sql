-- The scheduler's bookkeeping on timers: the re-registration high-water mark, cancellation
-- by the API/CLI, and the reason a row that cannot be planned was set aside.
ALTER TABLE timers
    ADD COLUMN handled_through timestamptz,
    ADD COLUMN cancelled_at timestamptz,
    ADD COLUMN error text,
    ADD CONSTRAINT timers_cancelled_is_done CHECK (cancelled_at IS NULL OR done),
    ADD CONSTRAINT timers_error_is_done CHECK (error IS NULL OR done);
