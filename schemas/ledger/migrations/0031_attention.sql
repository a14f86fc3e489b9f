-- 0031: attention earned. Each user's pacing gap adapts to engagement (docs/agent.md,
-- "Attention"): the dispatcher sets it at each new delivery, shorter when the person replied
-- within VIGIL_ATTENTION_REPLY_WINDOW_S of the previous one, longer when they did not,
-- within VIGIL_ATTENTION_MIN_GAP_S..VIGIL_ATTENTION_MAX_GAP_S, starting at the quiet end.
-- `vigil users attention USER --gap N` pins it (attention_pinned); `--gap auto` unpins.
ALTER TABLE users
    ADD COLUMN attention_gap_s      integer,
    ADD COLUMN attention_reason     text,
    ADD COLUMN attention_at         timestamptz,
    ADD COLUMN attention_pinned     boolean NOT NULL DEFAULT false,
    ADD COLUMN delivery_day         date,
    ADD COLUMN delivery_day_count   integer NOT NULL DEFAULT 0,
    ADD CONSTRAINT users_attention_gap_nonnegative CHECK (attention_gap_s IS NULL OR attention_gap_s >= 0);
