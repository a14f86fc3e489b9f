"""The worker's metrics: what an SRE asks of the heart of vigil. No user id as a label."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_CONSUMED = Counter("vigil_events_consumed_total", "Kafka messages the workers polled.")
EVENTS_RECORDED = Counter(
    "vigil_events_recorded_total", "Events recorded in the ledger, by result (new or duplicate).", ["result"]
)
EVENTS_UNDECODABLE = Counter(
    "vigil_events_undecodable_total", "Messages that did not decode and went to the dead-letter topic."
)
EVENTS_REROUTED = Counter(
    "vigil_events_rerouted_total",
    "Events read on a partition of another ledger shard than their user's, produced again to the user's home "
    "partition instead of recorded here.",
)
SHARD_UP = Gauge(
    "vigil_worker_shard_up",
    "1 while this worker records on the ledger shard; 0 while its partitions there are paused (shard down).",
    ["shard"],
)
SHARD_PARTITIONS = Gauge(
    "vigil_worker_shard_partitions", "Partitions this worker owns, by ledger shard (VIGIL_LEDGER_SHARDS).", ["shard"]
)
EVENTS_DEAD = Counter("vigil_events_dead_total", "Events that exhausted their attempts and became dead.")
CLAIM_ATTEMPTS = Counter("vigil_claim_attempts_total", "Events claimed, by attempt number (1, 2, 3+).", ["attempt"])
CLAIM_BATCH = Histogram(
    "vigil_claim_batch_events", "Events per claimed run.", buckets=(1, 2, 3, 5, 10, 20, 50, 100, 200)
)
RUNS = Counter(
    "vigil_runs_total",
    "Finished runs by outcome (message, nothing, deferred, failed, retry_later); one refused for its budget is none.",
    ["outcome"],
)
RUN_SECONDS = Histogram(
    "vigil_run_duration_seconds",
    "Agent run wall time, claim to finish commit.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
STALE_FINISHES = Counter(
    "vigil_stale_finishes_total", "Finishes refused because the partition changed hands (fencing worked)."
)
RELEASED = Counter("vigil_claims_released_total", "Claims handed back without counting an attempt (revoke, shutdown).")
LOST_FORGIVEN = Counter(
    "vigil_lost_claims_forgiven_total",
    "Claims a takeover counted as lost with a crashed worker that the worker, alive after losing the partition, "
    "gave back: the loss uncounted, a lone last attempt no longer its event's death.",
)
HANDED_OVER = Counter(
    "vigil_runs_handed_over_total",
    "Runs a revoke or a shutdown stopped at a step boundary (VIGIL_HANDOVER=step): released, their journal "
    "replayed by the next owner.",
)
REVOKE_FINISHED = Counter(
    "vigil_revoke_runs_finished_total",
    "Runs of a revoked partition that finished and committed within the revoke's grace instead of being released.",
)
# Revokes, hand-overs and the takeover's wait: milliseconds when no run moves, up to the grace
# (VIGIL_REVOKE_GRACE_S, at most 120 s) when runs do.
REBALANCE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0, 120.0)
REVOKE_SECONDS = Histogram(
    "vigil_worker_revoke_seconds",
    "Wall time of the consumer's revoke callback (the worker records no events meanwhile): setting the hand-over, "
    "or, when the ledger could not take it, the runs' whole grace.",
    buckets=REBALANCE_BUCKETS,
)
HANDOVER_SECONDS = Histogram(
    "vigil_worker_handover_seconds",
    "Wall time of a hand-over on the revoking worker: from the revoke until its runs of the partitions finished "
    "or were released (at most VIGIL_REVOKE_GRACE_S and a few seconds for their commits).",
    buckets=REBALANCE_BUCKETS,
)
HANDOVER_WAIT_SECONDS = Histogram(
    "vigil_worker_handover_wait_seconds",
    "How long a takeover waited for the previous owner's hand-over (its runs of the partitions finishing); "
    "the taking worker records the partitions meanwhile and claims nothing on them.",
    buckets=REBALANCE_BUCKETS,
)
HANDED_BACK = Counter(
    "vigil_claims_recovered_total", "Claims of a worker that lost its partition, handed back to pending at takeover."
)
HEALED = Counter(
    "vigil_claims_healed_total",
    "Claims at this worker's own epochs that no run held (a finish the ledger lost), released to pending.",
)
LONE_RUNS = Counter(
    "vigil_lone_runs_total",
    "Last attempts of events lost with their worker before, run with nothing else in flight (claim rule 3).",
)
EPOCHS_HELD = Gauge("vigil_partition_epochs_held", "Partitions this worker owns (fencing epochs held).")
AWAITING_TAKEOVER = Gauge(
    "vigil_partitions_awaiting_takeover",
    "Partitions assigned to this worker that it records but does not claim yet: their takeover waits for the "
    "previous owner's hand-over.",
)
CONSUMER_LAG = Gauge("vigil_consumer_lag_messages", "Messages behind the partition's high watermark.", ["partition"])
OLDEST_PENDING = Gauge(
    "vigil_oldest_pending_event_age_seconds", "Age of the oldest pending event in the ledger (all users)."
)
PENDING = Gauge("vigil_pending_events", "Events pending in the ledger, all users (every worker reports the same).")
RUNS_IN_FLIGHT = Gauge("vigil_runs_in_flight", "Runs executing in this worker now.")
FINISH_BATCH = Histogram(
    "vigil_finish_batch_runs",
    "Runs committed per finish transaction (group commit).",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500),
)
LEDGER_SECONDS = Histogram(
    "vigil_worker_ledger_seconds",
    "Wall time of the worker's ledger steps: a polled batch's record transaction, a claim pass, a group "
    "finish (including retries' waits).",
    ["step"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
EVENT_LOOP_LAG = Histogram(
    "vigil_worker_event_loop_lag_seconds",
    "How late the worker's event loop woke a timer (vigil.worker.loop_lag): what every model answer,"
    " claim and finish of this worker waits for the interpreter.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
TOPIC_PARTITIONS = Gauge(
    "vigil_events_topic_partitions",
    "Partitions of the events topic, as this worker's consumer sees them (alert when the workers hold fewer).",
)

# Every bounded label value starts at zero, so a dashboard shows the series before the first
# occurrence and increase() sees the first one (a series born at 1 has no increase).
for _result in ("new", "duplicate"):
    EVENTS_RECORDED.labels(_result)
for _attempt in ("1", "2", "3+"):
    CLAIM_ATTEMPTS.labels(_attempt)
for _outcome in ("message", "nothing", "deferred", "failed", "retry_later", "stale"):
    RUNS.labels(_outcome)
for _step in ("record", "claim", "finish"):
    LEDGER_SECONDS.labels(_step)

# Background tasks (services/vigil/worker/tasks.py, task_upkeep.py). Ledger-wide gauges: every
# worker reports the same value, so aggregate them with max(), never sum().
TASKS = Counter(
    "vigil_tasks_total",
    "Background tasks that reached a terminal status, by status (succeeded, failed, cancelled, timed_out, lost).",
    ["status"],
)
TASKS_IN_FLIGHT = Gauge("vigil_tasks_in_flight", "Background tasks this worker executes now.")
TASKS_QUEUED = Gauge("vigil_tasks_queued", "Background tasks waiting for a worker (ledger-wide: use max()).")
TASKS_RUNNING = Gauge("vigil_tasks_running", "Background tasks held by some worker (ledger-wide: use max()).")
TASK_HEARTBEAT_AGE = Gauge(
    "vigil_task_heartbeat_age_seconds",
    "Age of the oldest heartbeat among running tasks (ledger-wide: use max()); near VIGIL_TASK_STALE_S means a "
    "holder died and the reaper is about to take its task back.",
)
TASK_SECONDS = Histogram(
    "vigil_task_seconds",
    "Wall time of task executions whose outcome stood.",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600),
)
TASKS_REAPED = Counter(
    "vigil_tasks_reaped_total",
    "Tasks the reaper took from a holder or a deadline, by what they became (queued, lost, timed_out).",
    ["status"],
)
TASK_LEASES_LOST = Counter(
    "vigil_task_leases_lost_total", "Executions stopped because their lease was gone (reaped or timed out)."
)
TASK_SELF_FENCED = Counter(
    "vigil_task_self_fenced_total",
    "Executions their holder stopped because no heartbeat got through for half of VIGIL_TASK_STALE_S.",
)
TASK_LATE_OUTCOMES = Counter(
    "vigil_task_late_outcomes_total", "Task outcomes refused because another terminal outcome stood first."
)
TASK_RESULTS_REPORTED = Counter(
    "vigil_task_results_reported_total", "Result events produced for terminal tasks (one per task)."
)
for _status in ("succeeded", "failed", "cancelled", "timed_out", "lost"):
    TASKS.labels(_status)
for _status in ("queued", "lost", "timed_out"):
    TASKS_REAPED.labels(_status)
