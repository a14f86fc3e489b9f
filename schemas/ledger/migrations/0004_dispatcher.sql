-- 0004: the dispatcher's bookkeeping on outbox rows (when a delivery id was fixed, the
-- channel of the latest attempt, when a delivery died) and a bound on the urgent cap.
ALTER TABLE outbox
    ADD COLUMN fixed_at timestamptz,
    ADD COLUMN channel text,
    ADD COLUMN dead_at timestamptz,
    ADD CONSTRAINT outbox_fixed_with_delivery CHECK ((delivery_id IS NULL) = (fixed_at IS NULL)),
    ADD CONSTRAINT outbox_dead_has_time CHECK ((status = 'dead') = (dead_at IS NOT NULL)),
    ADD CONSTRAINT outbox_channel_valid CHECK (channel IS NULL OR channel IN ('webhook', 'kafka', 'log'));
CREATE INDEX outbox_by_delivery ON outbox (delivery_id) WHERE delivery_id IS NOT NULL;
CREATE INDEX outbox_dead ON outbox (dead_at) WHERE status = 'dead';

ALTER TABLE channels
    ADD CONSTRAINT channels_urgent_cap_nonnegative CHECK (urgent_daily_cap IS NULL OR urgent_daily_cap >= 0);
