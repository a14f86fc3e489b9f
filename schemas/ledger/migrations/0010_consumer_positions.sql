-- 0010: the ledger keeps its own consumer positions (see schema.sql, consumer_positions).
-- consumer_positions: the next offset of each topic partition that the ledger has recorded
-- everything before, written in the same transaction as the events it covers. On assignment
-- the worker resumes here, not at the group's committed offset: a ledger that lost its last
-- commits (a crash with asynchronous commit, a failover to an asynchronous replica, a restored
-- backup) re-reads those events, and the dedup key drops what it still has. A narrow table of
-- its own: the partitions row is locked FOR SHARE by every claim and finish.
CREATE TABLE consumer_positions (
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    next_offset bigint      NOT NULL,                     -- only ever grows (GREATEST on upsert)
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);
