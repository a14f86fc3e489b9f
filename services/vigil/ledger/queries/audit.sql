-- Audit: what operators did by hand.

-- name: audit_insert
-- Record an operator action (who, what, details).
INSERT INTO audit (actor, action, detail) VALUES (%(actor)s, %(action)s, %(detail)s)
