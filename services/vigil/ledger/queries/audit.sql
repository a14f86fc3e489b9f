-- Audit: what operators did by hand.

-- name: audit_insert
-- Record an operator action (who, what, details; never a secret or a token in detail).
INSERT INTO audit (actor, action, detail) VALUES (%(actor)s, %(action)s, %(detail)s)
