-- 0025: the outbox is analyzed after a million changes, as the history tables are (0024).
--
-- Every message is an insert and two or three updates (fixed, then delivered), and delivered
-- rows stay until retention: under load the default trigger (50 rows plus a tenth of the
-- table) was passed at every autovacuum round, 0.1-0.2 s of CPU every few seconds that the
-- events received meanwhile waited for. It was left at the default in 0024 because its
-- statistics steered the dispatcher's claim; the claim's statements now read the unfinished
-- rows once and the rest by index probes whatever the statistics say (queries/outbox.sql,
-- tests/test_dispatcher_plans.py), so stale statistics cost it nothing.
ALTER TABLE outbox SET (autovacuum_analyze_threshold = 1000000);
