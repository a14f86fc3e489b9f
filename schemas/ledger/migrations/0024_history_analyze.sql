-- 0024: the history tables are analyzed after a million changes, not a tenth of their rows.
--
-- event_keys, runs and the day partitions of events_finished only grow, until retention
-- deletes keys and runs by age and drops whole days. PostgreSQL analyzes a table once 50 rows
-- plus a tenth of it changed; a young table, and every new day's partition all day long,
-- passes that between two autovacuum rounds under load. At half of the e2e bench's saturated
-- rate (7,600 events/s, autovacuum looking every 5 s) each of them was analyzed every round:
-- about 0.3 s of CPU (30,000 sampled rows per table) packed into 0.8 s every 5 s, and on two
-- shared cores the events received meanwhile waited for it. Those waits were most of the
-- latency's p99 at that load (docs/performance.md, change 19).
-- No statement of the hot path reads their statistics (the record probes event_keys' primary
-- key, the finish only inserts into runs and the day); operators' look-ups go by index. A
-- million changes is still a fresh analyze every few minutes at that rate.
ALTER TABLE event_keys SET (autovacuum_analyze_threshold = 1000000);
ALTER TABLE runs SET (autovacuum_analyze_threshold = 1000000);
DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT inhrelid::regclass FROM pg_inherits WHERE inhparent = 'events_finished'::regclass LOOP
        EXECUTE format('ALTER TABLE %s SET (autovacuum_analyze_threshold = 1000000)', part);
    END LOOP;
END
$$;

-- The day partitions of events_finished from yesterday to `ahead` days after today (UTC),
-- plus the days in `days` and those of rows waiting in events_finished_default (which move
-- to their day). Serialised by an advisory lock: any number of schedulers may call it at
-- once. Returns how many partitions it made.
CREATE OR REPLACE FUNCTION ensure_event_partitions(ahead integer, days date[] DEFAULT '{}') RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    day date;
    part text;
    lo timestamptz;
    hi timestamptz;
    made integer := 0;
BEGIN
    -- "vigil-pa" in ASCII: one key for every process that makes partitions.
    PERFORM pg_advisory_xact_lock(8532478223426281825);
    FOR day IN
        SELECT d::date FROM generate_series(today - 1, today + ahead, interval '1 day') AS d
        UNION SELECT unnest(days)
        UNION SELECT DISTINCT (finished_at AT TIME ZONE 'UTC')::date FROM events_finished_default
        ORDER BY 1
    LOOP
        part := 'events_finished_p' || to_char(day, 'YYYYMMDD');
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_class WHERE relname = part AND relnamespace = current_schema()::regnamespace);
        lo := day::timestamp AT TIME ZONE 'UTC';
        hi := (day + 1)::timestamp AT TIME ZONE 'UTC';
        IF EXISTS (SELECT 1 FROM events_finished_default WHERE finished_at >= lo AND finished_at < hi) THEN
            -- Rows of this day wait in the default partition: the day is built beside it and
            -- attached once they moved (a partition cannot be made over rows the default holds).
            EXECUTE format('CREATE TABLE %I (LIKE events_finished INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
            EXECUTE format('INSERT INTO %I SELECT * FROM events_finished_default WHERE finished_at >= %L AND finished_at < %L',
                           part, lo, hi);
            DELETE FROM events_finished_default WHERE finished_at >= lo AND finished_at < hi;
            EXECUTE format('ALTER TABLE events_finished ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
        ELSE
            EXECUTE format('CREATE TABLE %I PARTITION OF events_finished FOR VALUES FROM (%L) TO (%L)', part, lo, hi);
        END IF;
        -- History: analyzed after a million changes, not a tenth of the rows (migration 0024).
        EXECUTE format('ALTER TABLE %I SET (autovacuum_analyze_threshold = 1000000)', part);
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$;
