-- 0007: how many of an event's claims were lost with their worker (a crash, a freeze past
-- the session timeout). A worker that dies takes every run in flight with it, and each of
-- those claims counted an attempt: an innocent event caught in three crashes of a poison
-- event's worker died with it. With this count the takeover can tell a claim that ran
-- alone from one that ran in company: a claim lost in company never uses up an event's
-- last attempt, and an event lost before runs its last attempt alone (claim rule 3,
-- services/vigil/worker/claims.py).
ALTER TABLE events ADD COLUMN lost_claims integer NOT NULL DEFAULT 0;
