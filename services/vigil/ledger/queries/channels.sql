-- Channels: where each user's deliveries go (operators set them; the dispatcher reads them
-- in its claim). A user without a row gets the log channel and the default limits.

-- name: channel_set
-- Create or replace a user's channel; %(keep_gap)s / %(keep_cap)s keep the stored limits.
INSERT INTO channels AS c (user_id, type, url, secret, sealed_with, gap_seconds, urgent_daily_cap)
VALUES (%(user_id)s, %(type)s, %(url)s, %(secret)s, %(sealed_with)s, %(gap_seconds)s, %(urgent_daily_cap)s)
ON CONFLICT (user_id) DO UPDATE
SET type = EXCLUDED.type,
    url = EXCLUDED.url,
    secret = EXCLUDED.secret,
    sealed_with = EXCLUDED.sealed_with,
    gap_seconds = CASE WHEN %(keep_gap)s THEN c.gap_seconds ELSE EXCLUDED.gap_seconds END,
    urgent_daily_cap = CASE WHEN %(keep_cap)s THEN c.urgent_daily_cap ELSE EXCLUDED.urgent_daily_cap END,
    updated_at = now()
RETURNING user_id, type, url, secret, sealed_with, gap_seconds, urgent_daily_cap, created_at, updated_at

-- name: channels_of_users
-- The channel rows of the users in %(users)s that have one (a dispatcher on a shard other than the catalog: channels live in the catalog).
SELECT user_id, type, url, secret, sealed_with, gap_seconds, urgent_daily_cap, created_at, updated_at
FROM channels WHERE user_id = ANY(%(users)s::text[])

-- name: channel_get
-- One user's channel row, if any.
SELECT user_id, type, url, secret, sealed_with, gap_seconds, urgent_daily_cap, created_at, updated_at
FROM channels WHERE user_id = %(user_id)s

-- name: channel_get_for_update
-- One user's channel row, locked: two operators editing one channel do not both rotate its secret.
SELECT user_id, type, url, secret, sealed_with FROM channels WHERE user_id = %(user_id)s FOR UPDATE

-- name: channel_pacing_state
-- A user's pacing state, for `vigil channels show`.
SELECT last_delivery_at, urgent_day, urgent_count FROM users WHERE user_id = %(user_id)s


-- name: attention_get
-- A user's earned gap and why (0031), for `vigil users show` and the console.
SELECT user_id, attention_gap_s, attention_reason, attention_at, attention_pinned, last_delivery_at,
       delivery_day, delivery_day_count
FROM users WHERE user_id = %(user_id)s

-- name: attention_set
-- An operator pins a user's gap (%(gap_s)s) or, with NULL, lets it adapt again from where it stands.
UPDATE users
SET attention_gap_s = coalesce(%(gap_s)s, attention_gap_s),
    attention_pinned = %(gap_s)s IS NOT NULL,
    attention_reason = %(reason)s,
    attention_at = %(now)s
WHERE user_id = %(user_id)s
RETURNING user_id, attention_gap_s, attention_reason, attention_at, attention_pinned, last_delivery_at,
          delivery_day, delivery_day_count
