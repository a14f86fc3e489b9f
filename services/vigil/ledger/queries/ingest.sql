-- Ingest: API tokens and webhook hooks (ingest reads them; `vigil tokens` and `vigil hooks` write them).
-- Revocations set a timestamp once and never clear it, so each write checks "still active".

-- name: token_create
-- A new API token; only its sha256 is stored. expires_at NULL: it never expires.
INSERT INTO api_tokens (id, name, token_hash, scopes, users, expires_at)
VALUES (%(id)s, %(name)s, %(token_hash)s, %(scopes)s, %(users)s, %(expires_at)s)
RETURNING id, name, created_at, scopes, users, expires_at

-- name: token_by_hash
-- The token a bearer presents, by the sha256 of what was presented (hot path, cached by ingest).
SELECT id, name, revoked_at, scopes, users, expires_at FROM api_tokens WHERE token_hash = %(token_hash)s

-- name: token_list
-- Every token, newest first, without hashes.
SELECT id, name, created_at, revoked_at, scopes, users, expires_at FROM api_tokens ORDER BY created_at DESC, id

-- name: token_revoke
-- Revoke a token that is still active; zero rows: unknown id or revoked already.
UPDATE api_tokens SET revoked_at = now()
WHERE id = %(id)s AND revoked_at IS NULL
RETURNING id, name, revoked_at

-- name: token_get
-- One token by id (to tell "unknown" from "revoked already").
SELECT id, name, created_at, revoked_at FROM api_tokens WHERE id = %(id)s

-- name: hook_create
-- A new webhook endpoint for one provider and one user.
INSERT INTO hooks (id, provider, user_id)
VALUES (%(id)s, %(provider)s, %(user_id)s)
RETURNING id, provider, user_id, created_at

-- name: hook_secret_add
-- Add a signing secret to a hook that is not disabled (a rotation keeps the older ones active).
INSERT INTO hook_secrets (hook_id, secret, sealed_with)
SELECT id, %(secret)s, %(sealed_with)s FROM hooks WHERE id = %(hook_id)s AND disabled_at IS NULL
RETURNING id, hook_id, created_at

-- name: hook_for_delivery
-- A hook and its active secrets, as a delivery needs them (hot path, cached by ingest).
SELECT h.id, h.provider, h.user_id, h.disabled_at,
       COALESCE(array_agg(s.secret ORDER BY s.id) FILTER (WHERE s.id IS NOT NULL), '{}') AS secrets,
       COALESCE(array_agg(s.sealed_with ORDER BY s.id) FILTER (WHERE s.id IS NOT NULL), '{}') AS sealed_with
FROM hooks h
LEFT JOIN hook_secrets s ON s.hook_id = h.id AND s.revoked_at IS NULL
WHERE h.id = %(hook_id)s
GROUP BY h.id

-- name: hook_list
-- Every hook with the ids of its active secrets, never the secrets themselves.
SELECT h.id, h.provider, h.user_id, h.created_at, h.disabled_at,
       COALESCE(array_agg(s.id ORDER BY s.id) FILTER (WHERE s.id IS NOT NULL), '{}') AS active_secret_ids
FROM hooks h
LEFT JOIN hook_secrets s ON s.hook_id = h.id AND s.revoked_at IS NULL
GROUP BY h.id
ORDER BY h.created_at DESC, h.id

-- name: hook_secret_revoke
-- Revoke one active secret of a hook; unless forced, only while another active secret remains.
UPDATE hook_secrets SET revoked_at = now()
WHERE id = %(secret_id)s AND hook_id = %(hook_id)s AND revoked_at IS NULL
  AND (%(force)s OR EXISTS (
        SELECT 1 FROM hook_secrets other
        WHERE other.hook_id = %(hook_id)s AND other.id <> %(secret_id)s AND other.revoked_at IS NULL))
RETURNING id, hook_id, revoked_at

-- name: hook_secret_get
-- One secret's state (to explain a refused revocation), never its value.
SELECT id, hook_id, created_at, revoked_at FROM hook_secrets WHERE id = %(secret_id)s AND hook_id = %(hook_id)s

-- name: hook_lock
-- Serialise changes to one hook's secrets (two revocations must not leave it with none).
SELECT id, disabled_at FROM hooks WHERE id = %(hook_id)s FOR UPDATE

-- name: token_hashes
-- Every token hash: ingest's negative cache under a flood of unknown tokens (a set, refreshed at most once a second).
SELECT token_hash FROM api_tokens

-- name: hook_ids
-- Every hook id: ingest's negative cache under a flood of deliveries to unknown hooks.
SELECT id FROM hooks

-- name: hook_disable
-- Disable a hook that is still enabled (deliveries get 404 within VIGIL_INGEST_AUTH_CACHE_S); zero rows: unknown or disabled already.
UPDATE hooks SET disabled_at = now()
WHERE id = %(hook_id)s AND disabled_at IS NULL
RETURNING id, provider, user_id, disabled_at
