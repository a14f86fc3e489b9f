-- Traces (vigil.tracing): read only when OTEL_EXPORTER_OTLP_ENDPOINT turned them on.

-- name: event_trace_context
-- A run's events' stored trace context (the worker's record span wrote it into headers) and claim time: the run's span continues the first and links to the others.
SELECT id, headers->>'traceparent' AS traceparent, headers->>'tracestate' AS tracestate, claimed_at
FROM events
WHERE id = ANY(%(ids)s::bigint[])
ORDER BY id
