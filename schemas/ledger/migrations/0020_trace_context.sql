-- 0020: the trace context a run's writes carry (vigil.tracing, docs/operations.md "Traces").
--
-- A W3C traceparent, set by the worker's finish only when traces are on: the dispatcher's
-- delivery span continues the run's trace from the outbox row, and the scheduler's fire span
-- from the timer the run set. Nullable without a default: adding the columns rewrites nothing.
ALTER TABLE outbox ADD COLUMN traceparent text;
ALTER TABLE timers ADD COLUMN traceparent text;
