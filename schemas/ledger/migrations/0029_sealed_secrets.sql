-- 0029: secrets at rest are sealed (Fernet) with VIGIL_SECRET_KEY. sealed_with is the id of the
-- key that sealed the row's secret; NULL: the secret is in clear (rows written before this
-- migration, or without a key). SQL cannot see the key, so existing rows stay in clear until
-- `vigil secrets rotate` (or `vigil migrate` with the key set) seals them (docs/operations.md).
ALTER TABLE hook_secrets ADD COLUMN sealed_with text;
ALTER TABLE channels ADD COLUMN sealed_with text;
