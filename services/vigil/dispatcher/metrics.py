"""The dispatcher's Prometheus metrics, named for the question each answers.

Labels are bounded: ``channel`` (webhook, kafka, log), ``result``, ``reason``, ``status``.
Never a user id or a delivery id (those are in the ledger: `vigil outbox USER`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BACKLOG = Gauge(
    "vigil_outbox_backlog_messages",
    "Outbox messages not yet delivered, by status"
    " (pending: held by pacing or waiting out a backoff; sending: in flight), by ledger shard.",
    ["status", "shard"],
)
OLDEST_AGE = Gauge(
    "vigil_outbox_oldest_age_seconds",
    "Age of the oldest undelivered outbox message (a gap's worth is normal; far more means deliveries are stuck), "
    "by ledger shard.",
    ["shard"],
)
SHARD_UP = Gauge(
    "vigil_dispatcher_shard_up",
    "1 while this dispatcher's loop on the ledger shard goes through, 0 after a ledger error until it does again; "
    "the other shards are served meanwhile.",
    ["shard"],
)
DELIVERIES = Counter(
    "vigil_deliveries_total",
    "Deliveries that reached a final result, by channel and result (delivered, dead).",
    ["channel", "result"],
)
RETRIES = Counter(
    "vigil_delivery_retries_total",
    "Delivery attempts after the first, by channel and reason (failed: the receiver or broker said try again; "
    "lost: the sending dispatcher vanished and the lease ran out).",
    ["channel", "reason"],
)
SETTLED_AFTER_RECONNECT = Counter(
    "vigil_delivery_outcomes_settled_after_reconnect_total",
    "Sends whose outcome could not be recorded when they finished (the ledger went away) and was recorded "
    "as soon as it answered again, instead of the row waiting out its lease.",
)
DEAD = Counter(
    "vigil_dead_deliveries_total",
    "Deliveries given up on, by channel and reason (rejected: a final answer such as 410; exhausted: "
    "VIGIL_DELIVERY_MAX_ATTEMPTS failed attempts; lost: no outcome recorded within the attempts).",
    ["channel", "reason"],
)
JOINED = Histogram(
    "vigil_delivery_joined_messages",
    "Outbox messages joined into one delivery (held during the gap).",
    buckets=(1, 2, 3, 5, 10, 20, 50, 100),
)
LATENCY = Histogram(
    "vigil_delivery_latency_seconds",
    "Time from a message's outbox row being written to its delivery being accepted, by channel (pacing included).",
    ["channel"],
    buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14_400, 43_200, 86_400),
)
URGENT_BYPASSES = Counter(
    "vigil_urgent_bypasses_total",
    "Deliveries sent inside a user's gap because a message was urgent (each counts against the urgent daily cap).",
)
SUPERSEDED = Counter(
    "vigil_delivery_superseded_total",
    "Attempt outcomes dropped because the attempt's lease had been taken over (the delivery went out again: "
    "raise VIGIL_DELIVERY_LEASE_S if this grows without crashes).",
    ["channel"],
)
CLAIM_CONFLICTS = Counter(
    "vigil_dispatcher_claim_conflicts_total",
    "Claims rolled back because a row changed under the user lock (should stay 0; a rising count is a bug).",
)
LAST_PASS = Gauge(
    "vigil_dispatcher_last_pass_timestamp_seconds",
    "Unix time of the newest claim this dispatcher has finished (claimed, sent, every outcome recorded, and so "
    "every claim before it), by ledger shard; a stale value means that shard's loop is stuck.",
    ["shard"],
)
LAST_SWEEP = Gauge(
    "vigil_dispatcher_last_sweep_timestamp_seconds",
    "Unix time the newest sweep this dispatcher has finished started: everything due then has been claimed, "
    "sent and recorded, by ledger shard.",
    ["shard"],
)
SWEEPS = Counter(
    "vigil_dispatcher_sweeps_total",
    "Sweeps through every user holding messages; between them only users with new messages, a delivery that just "
    "ended, or a gap, backoff or lease seen to end are looked at.",
)
SWEEP_PAUSE = Gauge(
    "vigil_dispatcher_sweep_pause_seconds",
    "How long after the last sweep the next one starts: nine times what its closing claim took, at least the "
    "poll interval, at most 60 s. A held message whose gap has passed waits up to this long if this dispatcher "
    "has not seen its user since it started; it grows with the users holding messages.",
)
WAKEUPS = Gauge(
    "vigil_dispatcher_wakeups",
    "Users holding messages that this dispatcher will look at again between sweeps when their gap, backoff or "
    "lease ends (at most 100,000; the sweeps find the rest).",
)

# Every bounded label value starts at zero, so increase() sees a channel's first dead delivery.
for _channel in ("webhook", "kafka", "log"):
    for _result in ("delivered", "dead"):
        DELIVERIES.labels(_channel, _result)
    for _reason in ("rejected", "exhausted", "lost"):
        DEAD.labels(_channel, _reason)
    for _reason in ("failed", "lost"):
        RETRIES.labels(_channel, _reason)
    LATENCY.labels(_channel)
    SUPERSEDED.labels(_channel)
ATTENTION_OUTCOMES = Counter(
    "vigil_attention_outcomes_total",
    "New deliveries by whether the person replied (a chat message) to the previous one within "
    "VIGIL_ATTENTION_REPLY_WINDOW_S: replied, unanswered. Reply rate = replied / all. "
    "Counted while VIGIL_ATTENTION_ADAPT is on.",
    ["outcome"],
)
DELIVERIES_PER_USER_DAY = Histogram(
    "vigil_deliveries_per_user_day",
    "New deliveries one user received in one day (observed at their first delivery of a later day): "
    "how often the agent interrupts a person, without a user label.",
    buckets=(1, 2, 3, 5, 8, 13, 21, 34, 55),
)
