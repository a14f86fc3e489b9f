-- 0028: console sessions and API token expiry (issue 46). The console's cookie carried the
-- raw API token with no expiry, and its CSRF value was a fixed HMAC of the token. A login now
-- makes a server-side session: the cookie holds a random id (stored as its sha256), the CSRF
-- value is random per session, and logout or expiry ends it here, whatever the browser keeps.
ALTER TABLE api_tokens ADD COLUMN expires_at timestamptz;

CREATE TABLE console_sessions (
    id_hash     text PRIMARY KEY,
    token_id    text        NOT NULL REFERENCES api_tokens (id),
    csrf        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    ended_at    timestamptz,
    CONSTRAINT console_sessions_expire_after_start CHECK (expires_at > created_at)
);
CREATE INDEX console_sessions_by_expiry ON console_sessions (expires_at);
