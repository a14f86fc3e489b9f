-- 0027: timers remember the API token that created or last registered them, so the timers API
-- can bound live timers per token (VIGIL_TIMER_QUOTA_PER_TOKEN) as well as per user: user ids
-- in a path are the caller's to invent, so a per-user quota alone did not bound one token.
-- NULL: set by a run (follow-ups, approval expiries) or by `vigil timers add`.
ALTER TABLE timers ADD COLUMN token_id text;
CREATE INDEX timers_live_by_token ON timers (token_id) WHERE NOT done AND token_id IS NOT NULL;
