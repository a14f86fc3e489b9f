-- In-flight runs moved to a newer profile version (`vigil runs upgrade`). Read services/vigil/ledger/upgrades.py.

-- name: upgrades_in_flight
-- The live run journals of a profile on a version older than `to_version` (their start's, or their latest upgrade's), with what they hold and whether a worker holds them now; background tasks (task:) keep their delegating run's version.
SELECT s.run_key, s.user_id, s.version AS from_version,
       (SELECT count(*) FROM run_journal j WHERE j.run_key = s.run_key AND j.finished_at IS NULL) AS steps,
       (SELECT count(*) FROM run_journal j
        WHERE j.run_key = s.run_key AND j.finished_at IS NULL AND j.kind = 'call' AND j.outcome IS NOT NULL) AS calls_done,
       (SELECT count(*) FROM run_journal j
        WHERE j.run_key = s.run_key AND j.finished_at IS NULL AND j.kind = 'call' AND j.outcome IS NULL) AS calls_in_doubt,
       EXISTS (SELECT 1 FROM events e
               WHERE e.user_id = s.user_id AND e.status = 'running'
                 AND e.id IN (SELECT json_array_elements_text(s.events)::bigint)) AS claimed
FROM (
    SELECT j.run_key, j.user_id, j.body -> 'start' -> 'events' AS events,
           greatest((j.body -> 'start' -> 'profile' ->> 1)::int,
                    (SELECT max(u.to_version) FROM run_upgrades u WHERE u.run_key = j.run_key)) AS version
    FROM run_journal j
    WHERE j.step = 1 AND j.kind = 'model' AND j.finished_at IS NULL AND NOT starts_with(j.run_key, 'task:')
      AND j.body -> 'start' -> 'profile' ->> 0 = %(profile)s
) s
WHERE s.version < %(to_version)s
ORDER BY s.run_key

-- name: upgrades_move
-- Moves these runs (read by upgrades_in_flight in the same transaction) to `to_version`: one row each, for those whose journal is still live (a run that finished meanwhile finished on its version). Returns the runs moved.
INSERT INTO run_upgrades (run_key, user_id, profile, from_version, to_version, made_by)
SELECT m.run_key, m.user_id, %(profile)s, m.from_version, %(to_version)s, %(made_by)s
FROM unnest(%(run_keys)s::text[], %(user_ids)s::text[], %(from_versions)s::int[]) AS m(run_key, user_id, from_version)
JOIN run_journal j ON j.run_key = m.run_key AND j.step = 1 AND j.finished_at IS NULL
RETURNING run_key

-- name: upgrades_latest
-- The version a run was last moved to (a replay goes on under it), if any.
SELECT max(u.to_version) AS to_version
FROM run_upgrades u
WHERE u.run_key = %(run_key)s AND u.profile = %(profile)s

-- name: upgrades_of_run
-- The upgrades of a run for operators, oldest first: its key's and a later attempt's (<key>~<attempt>).
SELECT u.run_key, u.profile, u.from_version, u.to_version, u.made_at, u.made_by
FROM run_upgrades u
WHERE u.user_id = %(user_id)s AND (u.run_key = %(run_key)s OR starts_with(u.run_key, %(run_key)s || '~'))
ORDER BY u.made_at, u.id
