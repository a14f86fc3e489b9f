-- 0013: scoped API tokens. A token may carry the route families it may use (scopes) and the
-- users it may act for (exact ids, or prefixes written `prefix*`). NULL means unrestricted:
-- every token created before this migration keeps the full scope it had.
ALTER TABLE api_tokens
    ADD COLUMN scopes text[],
    ADD COLUMN users  text[],
    ADD CONSTRAINT api_tokens_scopes_valid
        CHECK (scopes <@ ARRAY['events', 'messages', 'timers', 'approvals', 'admin']::text[]);
