-- Secrets at rest (hook_secrets.secret, channels.secret): which key sealed them, and
-- re-sealing one row at a time (vigil.ledger.sealing; SQL never sees a key).

-- name: secrets_by_key
-- How many stored secrets each key sealed, per table (sealed_with NULL: in clear).
SELECT 'hook_secrets' AS tbl, sealed_with, count(*) AS secrets FROM hook_secrets GROUP BY sealed_with
UNION ALL
SELECT 'channels', sealed_with, count(*) FROM channels WHERE secret IS NOT NULL GROUP BY sealed_with
ORDER BY 1, 2 NULLS FIRST

-- name: secrets_not_sealed_with
-- Every stored secret not sealed with %(key_id)s in the bound form (prefix %(bound)s), in clear included, for a rotation; owner is the row's place.
SELECT 'hook_secrets' AS tbl, id::text AS id, hook_id AS owner, secret, sealed_with
FROM hook_secrets WHERE sealed_with IS DISTINCT FROM %(key_id)s OR secret NOT LIKE %(bound)s
UNION ALL
SELECT 'channels', user_id, user_id, secret, sealed_with
FROM channels WHERE secret IS NOT NULL AND (sealed_with IS DISTINCT FROM %(key_id)s OR secret NOT LIKE %(bound)s)

-- name: hook_secret_reseal
-- Replace one hook secret's stored text, only if it still holds what the rotation read.
UPDATE hook_secrets SET secret = %(new)s, sealed_with = %(key_id)s
WHERE id = %(id)s::bigint AND secret = %(old)s

-- name: channel_secret_reseal
-- Replace one channel secret's stored text, only if it still holds what the rotation read.
UPDATE channels SET secret = %(new)s, sealed_with = %(key_id)s
WHERE user_id = %(id)s AND secret = %(old)s
