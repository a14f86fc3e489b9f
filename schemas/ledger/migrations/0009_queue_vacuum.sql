-- 0009: vacuum the queue tables as fast as they churn. Every event is inserted, then updated
-- twice (claim, finish); every message is inserted and updated as it is delivered. The dead
-- row versions stay in the partial indexes the claim walks (events_pending_by_user, ...)
-- until VACUUM removes them, and with the default thresholds (20% of the table) autovacuum
-- waited until a busy table held twice as many dead rows as live ones: after a 20-second
-- burst, 119,000 dead to 57,000 live, and at a steady 680 events/s the median time from
-- recorded to run was 0.7-1.3 s instead of 75-80 ms, until a 0.12 s VACUUM put it back.
-- Fixed thresholds instead of a share of the table: a few thousand dead rows, whatever the
-- size; and no cost-based pauses, since these vacuums are small and frequent.
ALTER TABLE events SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);
