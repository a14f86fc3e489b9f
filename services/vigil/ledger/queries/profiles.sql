-- Agent profiles (docs/agent.md, "Profiles"): versions never change, an update adds the next
-- one; assignments map user ids and prefix patterns to a profile name.

-- name: profiles_add_version
-- A profile's next version (1 for a new profile); zero rows when `expect` (the version the caller read, 0 for a new profile) is no longer the latest.
INSERT INTO profiles (name, version, spec, created_by)
SELECT %(name)s, %(expect)s + 1, %(spec)s, %(created_by)s
WHERE %(expect)s = (SELECT coalesce(max(version), 0) FROM profiles WHERE name = %(name)s)
ON CONFLICT (name, version) DO NOTHING
RETURNING name, version, spec, created_at, created_by

-- name: profiles_get
-- One version of a profile, or its latest when version is NULL.
SELECT name, version, spec, created_at, created_by FROM profiles
WHERE name = %(name)s AND (%(version)s::int IS NULL OR version = %(version)s::int)
ORDER BY version DESC LIMIT 1

-- name: profiles_history
-- Every version of a profile, oldest first.
SELECT name, version, spec, created_at, created_by FROM profiles WHERE name = %(name)s ORDER BY version

-- name: profiles_latest
-- Every profile's latest version, by name.
SELECT DISTINCT ON (name) name, version, spec, created_at, created_by FROM profiles ORDER BY name, version DESC

-- name: profiles_assign
-- Give the users a pattern matches a profile (replacing what it gave them before).
INSERT INTO profile_assignments (pattern, profile) VALUES (%(pattern)s, %(profile)s)
ON CONFLICT (pattern) DO UPDATE SET profile = EXCLUDED.profile, assigned_at = now()
RETURNING pattern, profile, assigned_at

-- name: profiles_unassign
-- Remove an assignment; its users fall back to the next pattern that matches them, or the default.
DELETE FROM profile_assignments WHERE pattern = %(pattern)s RETURNING pattern, profile, assigned_at

-- name: profiles_assignments
-- Every assignment, by pattern.
SELECT pattern, profile, assigned_at FROM profile_assignments ORDER BY pattern

-- name: profiles_resolved
-- What a worker caches (for VIGIL_PROFILE_CACHE_S): every assignment with the latest version of its profile.
SELECT a.pattern, p.name, p.version, p.spec
FROM profile_assignments a
JOIN LATERAL (SELECT name, version, spec FROM profiles WHERE name = a.profile ORDER BY version DESC LIMIT 1) p ON true

-- name: profiles_session_pin
-- The profile a session's latest run used: a resumed session keeps it until the session ends.
SELECT profile, profile_version FROM runs
WHERE user_id = %(user_id)s AND session_id = %(session_id)s
ORDER BY started_at DESC LIMIT 1
