-- 0022: a claim written once per run (issue 12 point 2, docs/scaling.md "A claim written once
-- per run").
--
-- The claim used to rewrite every claimed event row (pending -> running: a new tuple, payload
-- included, and new entries in the live queue's indexes, never HOT). Now the claim writes one
-- `claims` row per run naming its events, and the event row is written only when it is
-- recorded and when it leaves the queue (its finish moves it to its day). The physical table
-- is renamed `event_rows`; `events` becomes a view that derives each event's `running`
-- status, its counted attempt and its claim epoch from the claims, so operators read the same
-- columns with the same meanings.
ALTER TABLE events RENAME TO event_rows;
ALTER SEQUENCE events_id_seq RENAME TO event_rows_id_seq;

CREATE TABLE claims (
    user_id    text        PRIMARY KEY,
    topic      text        NOT NULL,
    partition  integer     NOT NULL,
    epoch      bigint      NOT NULL,
    event_ids  bigint[]    NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT claims_has_events CHECK (cardinality(event_ids) > 0)
);
CREATE INDEX claims_by_epoch ON claims (topic, partition, epoch);
ALTER TABLE claims SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- Claims in flight at the upgrade become claims rows: per user, the rows running under its
-- newest epoch, under its home partition (a user with no users row, which no worker claims
-- for, under the partition its first claimed row arrived on). The attempt they counted at
-- claim moves to the claim (the row is stored with the attempts before it), as a claim made
-- from now on.
INSERT INTO claims (user_id, topic, partition, epoch, event_ids, claimed_at)
SELECT e.user_id, coalesce(u.home_topic, min(e.kafka_topic), ''), coalesce(u.home_partition, min(e.kafka_partition), 0),
       e.claim_epoch, array_agg(e.id ORDER BY e.id), coalesce(max(e.claimed_at), now())
FROM event_rows e
LEFT JOIN users u ON u.user_id = e.user_id
WHERE e.status = 'running'
  AND e.claim_epoch = (SELECT max(r.claim_epoch) FROM event_rows r WHERE r.user_id = e.user_id AND r.status = 'running')
GROUP BY e.user_id, u.home_topic, u.home_partition, e.claim_epoch;
UPDATE event_rows e
SET status = 'pending', attempts = greatest(e.attempts - 1, 0)
FROM claims c
WHERE e.status = 'running' AND c.user_id = e.user_id AND e.id = ANY(c.event_ids);
-- Rows still running under an older epoch (a takeover that had not handed them back): back to
-- pending as the takeover would have (their attempt counted, lost with their worker).
UPDATE event_rows
SET status = 'pending', claim_epoch = NULL, lost_claims = lost_claims + 1,
    error = 'claim abandoned at the upgrade to per-run claims (epoch ' || claim_epoch || ')'
WHERE status = 'running';

-- The stored row is never running: the claims say which pending rows are.
ALTER TABLE events_live ADD CONSTRAINT events_live_never_running CHECK (status = 'pending');
DROP INDEX events_running_by_user;

-- What operators query as `events`: every column of the stored row, with a claimed row's
-- status `running`, its attempts counting the claim's attempt and its claim epoch and time
-- the claim's. Two arms, so a filter on a finished status or a user reaches the partitions
-- and their indexes.
CREATE VIEW events AS
SELECT e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.headers, e.occurred_at,
       e.received_at, e.recorded_at, e.status, e.attempts, e.transient_failures, e.claim_epoch, e.claimed_at,
       e.next_attempt_at, e.finished_at, e.error, e.run_id, e.retried_by, e.retried_at, e.kafka_topic,
       e.kafka_partition, e.kafka_offset, e.lost_claims
FROM event_rows e
WHERE e.status IN ('done', 'dead')
UNION ALL
SELECT e.id, e.user_id, e.source, e.source_id, e.kind, e.payload, e.session_id, e.headers, e.occurred_at,
       e.received_at, e.recorded_at,
       CASE WHEN c.user_id IS NULL THEN e.status ELSE 'running' END,
       e.attempts + CASE WHEN c.user_id IS NULL THEN 0 ELSE 1 END, e.transient_failures,
       coalesce(c.epoch, e.claim_epoch), coalesce(c.claimed_at, e.claimed_at),
       CASE WHEN c.user_id IS NULL THEN e.next_attempt_at END,
       e.finished_at, e.error, e.run_id, e.retried_by, e.retried_at, e.kafka_topic,
       e.kafka_partition, e.kafka_offset, e.lost_claims
FROM event_rows e
LEFT JOIN claims c ON c.user_id = e.user_id AND e.id = ANY(c.event_ids)
WHERE e.status = 'pending';
