"""The scheduler's metrics. Labels are bounded: a timer kind (followup, schedule,
approval_expiry), a catch-up policy (coalesce, each, skip), an approval outcome, a ledger
shard's index (VIGIL_LEDGER_SHARDS; "0" with one shard). Never a user id or a timer id."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_FIRED = Counter(
    "vigil_timer_events_total",
    "Timer events the broker acknowledged and the ledger committed, by timer kind and catch-up policy.",
    ["kind", "catch_up"],
)
OCCURRENCES_SKIPPED = Counter(
    "vigil_timer_skipped_occurrences_total",
    "Occurrences passed over without their own event (coalesced, beyond the each cap, skip policy, "
    "older than max_lateness), by timer kind and catch-up policy.",
    ["kind", "catch_up"],
)
LATENESS = Histogram(
    "vigil_timer_lateness_seconds",
    "From an occurrence's scheduled instant to the broker's acknowledgement of its event, by timer kind.",
    ["kind"],
    # From the tick's own jitter (sub-second) to an outage of a week.
    buckets=(0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400, 7 * 86400),
)
DUE_BACKLOG = Gauge(
    "vigil_timer_due_backlog_timers",
    "Live timers whose due time has passed and that no pass has handled yet (all replicas), by ledger shard.",
    ["shard"],
)
OLDEST_DUE = Gauge(
    "vigil_timer_oldest_due_age_seconds",
    "How long the oldest unhandled due timer has been waiting (0 when none), by ledger shard.",
    ["shard"],
)
PASS_SECONDS = Histogram(
    "vigil_scheduler_pass_duration_seconds",
    "One scheduler pass: lock a batch of due timers, plan, produce and wait for acks, commit.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SHARD_UP = Gauge(
    "vigil_scheduler_shard_up",
    "1 when this scheduler's last pass on the ledger shard committed, 0 while it fails (the shard or the broker "
    "away); the other shards are served meanwhile.",
    ["shard"],
)
PASS_FAILURES = Counter(
    "vigil_scheduler_pass_failures_total",
    "Passes rolled back, by reason (broker: no acknowledgement; ledger: database error; error: "
    "anything else, with a traceback in the log). Their timers stay due and are retried.",
    ["reason"],
)
TIMERS_SET_ASIDE = Counter(
    "vigil_timer_set_aside_total",
    "Timers the scheduler could not plan (a zone or cron that no longer parses) and marked done with the reason.",
)
for _reason in ("broker", "ledger", "error"):
    PASS_FAILURES.labels(_reason)
APPROVAL_EXPIRIES = Counter(
    "vigil_approval_expiries_total",
    "Approval expiry timers handled, by what stood afterwards (expired, yes by policy, escalated, "
    "already answered, unknown request).",
    ["outcome"],
)
PRUNED = Counter(
    "vigil_ledger_pruned_rows_total",
    "Rows retention deleted from the ledger (finished events, delivered or dead outbox rows, runs, done timers, "
    "expired dedup keys), by ledger shard.",
    ["table", "shard"],
)

# What retention deletes from (``vigil.ledger.retention.prune``'s counts).
PRUNED_TABLES = ("events", "outbox", "runs", "timers", "event_keys", "run_journal")

# Every bounded label value starts at zero, so increase() sees the first occurrence of each.
for _kind in ("followup", "schedule", "approval_expiry"):
    LATENESS.labels(_kind)
    for _policy in ("coalesce", "each", "skip"):
        EVENTS_FIRED.labels(_kind, _policy)
        OCCURRENCES_SKIPPED.labels(_kind, _policy)


def start_shards(shards: int) -> None:
    """Every shard's per-shard series at zero from the start, so increase() sees the first failure."""
    for shard in map(str, range(shards)):
        DUE_BACKLOG.labels(shard)
        OLDEST_DUE.labels(shard)
        SHARD_UP.labels(shard).set(1)
        for table in PRUNED_TABLES:
            PRUNED.labels(table, shard)


for _outcome in ("expired", "yes", "no", "escalated", "unknown", "not_yet_due"):
    APPROVAL_EXPIRIES.labels(_outcome)
REVIEWS_SCHEDULED = Counter(
    "vigil_memory_reviews_scheduled_total",
    "Memory reviews this scheduler queued (dreaming, VIGIL_DREAM_AFTER_SESSIONS): at most one open per user.",
)
