-- 0032: answers where the person is. An approval question's delivery carries structured
-- actions (approve / deny, each a signed single-use answer URL that expires with the
-- deadline), fixed by the worker's finish with the message so every copy of the delivery
-- carries the same bytes; and every answer records the path it came by, so an action URL
-- used a second time is told apart from an answer given another way.
ALTER TABLE outbox ADD COLUMN actions jsonb;
ALTER TABLE approvals ADD COLUMN answered_via text;
ALTER TABLE approvals ADD CONSTRAINT approvals_answered_via_valid
    CHECK (answered_via IS NULL OR answered_via IN ('api', 'chat', 'action', 'operator'));
