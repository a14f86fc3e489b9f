-- 0037: a background task runs with the profile version its delegating run ran with
-- (docs/agent.md, "Profiles"): its model, limits and tool set, not the deployment's. Written
-- by the run's fenced finish with the task; NULL: the run had the default profile.
ALTER TABLE tasks
    ADD COLUMN profile         text,
    ADD COLUMN profile_version integer;
