-- 0038: the shard map (issue 41; docs/architecture.md, "Shards"). Which ledger shard holds each
-- Kafka partition of the events topic, read from the catalog (shard 0). A partition without a
-- row follows the rule partition % shards (vigil.ledger.shardmap); `vigil migrate` seeds the
-- rows of the configured partitions from it and never rewrites one, and moving a partition is
-- changing its row.
CREATE TABLE shard_map (
    partition   integer     PRIMARY KEY,
    shard       integer     NOT NULL,
    assigned_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT shard_map_partition_valid CHECK (partition >= 0),
    CONSTRAINT shard_map_shard_valid CHECK (shard >= 0)
);
-- Every partition a worker ever held has its users in this database, which is shard 0 of any
-- map made from here: its row says so before a map with more shards can put it elsewhere.
INSERT INTO shard_map (partition, shard) SELECT DISTINCT partition, 0 FROM partitions;
