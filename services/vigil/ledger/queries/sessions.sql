-- Console sessions (0028): a login's random id, stored as its sha256, bound to one API token.
-- A session ends at expires_at or at logout (ended_at), whichever comes first.

-- name: session_create
-- A new session for a token, with its CSRF value and its end.
INSERT INTO console_sessions (id_hash, token_id, csrf, created_at, expires_at)
VALUES (%(id_hash)s, %(token_id)s, %(csrf)s, %(now)s, %(expires_at)s)

-- name: session_purge
-- Sessions past their end, ended or not (by the expiry index): each login sweeps them.
DELETE FROM console_sessions WHERE expires_at <= %(now)s

-- name: session_by_hash
-- The session a cookie names and its token, as a request's authentication needs them.
SELECT s.token_id, s.csrf, s.expires_at, s.ended_at,
       t.name, t.revoked_at, t.scopes, t.users, t.expires_at AS token_expires_at
FROM console_sessions s JOIN api_tokens t ON t.id = s.token_id
WHERE s.id_hash = %(id_hash)s

-- name: session_end
-- Logout: end a session still open; zero rows: unknown or ended already.
UPDATE console_sessions SET ended_at = %(now)s
WHERE id_hash = %(id_hash)s AND ended_at IS NULL
RETURNING token_id

-- name: session_hashes
-- Every live session's hash: the console's miss guard under a flood of unknown cookies.
SELECT id_hash FROM console_sessions WHERE ended_at IS NULL AND expires_at > %(now)s
