-- 0034: agent profiles (docs/agent.md, "Profiles"). A profile is a model, a system prompt,
-- limits, a tool set with permissions, MCP server names, event policies and a daily token
-- budget, kept as a JSON spec. Versions are never changed: `vigil profiles update` adds the
-- next one. Users get a profile by exact id or by a prefix pattern (`team-a/*`); the most
-- specific assignment wins. A run records the profile version it ran with.
CREATE TABLE profiles (
    name        text        NOT NULL,
    version     integer     NOT NULL,
    spec        jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    created_by  text        NOT NULL,
    PRIMARY KEY (name, version),
    CONSTRAINT profiles_name_valid CHECK (name ~ '^[a-z][a-z0-9_-]{0,63}$' AND name <> 'default'),
    CONSTRAINT profiles_version_valid CHECK (version >= 1)
);
CREATE TABLE profile_assignments (
    pattern     text        PRIMARY KEY,                  -- a user id, or a prefix ending in '*'
    profile     text        NOT NULL,
    assigned_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT profile_assignments_pattern_valid CHECK (strpos(pattern, '*') IN (0, length(pattern)))
);
-- budget_notices: the one notice per user and UTC day that their daily token budget is spent
-- (docs/agent.md, "Budgets"); its outbox row is written by the same statement.
CREATE TABLE budget_notices (
    user_id     text        NOT NULL,
    day         date        NOT NULL,
    profile     text        NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, day)
);
ALTER TABLE runs ADD COLUMN profile text;
ALTER TABLE runs ADD COLUMN profile_version integer;
