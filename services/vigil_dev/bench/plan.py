"""How big each workload is: the full run (``make bench``, under 10 minutes on 2 cores) and
the quick smoke run (``--quick``, under 2 minutes, only checks that every figure comes out)."""

from __future__ import annotations

from dataclasses import dataclass

from vigil.worker.settings import DEFAULT_BATCH_WINDOW_MS

# The second latency figure's window: small enough that the runtime's own latency shows,
# large enough that a burst of one user's messages still shares a run.
SMALL_WINDOW_MS = 10


@dataclass(frozen=True)
class Plan:
    name: str
    rounds: int  # measured rounds per figure (the median is printed)
    partitions: int  # of the events topic
    users: int  # the end-to-end workloads' user count
    raw_events: int  # raw Kafka and raw PostgreSQL: events per round
    record_events: int  # record_events_per_s: events per round
    e2e_seconds: float  # end-to-end throughput: how long each round offers load
    search_rounds: int  # uncounted e2e rounds at most, looking for the rate the workers keep up with
    latency_seconds: float  # latency at half load: how long each round offers load
    memory_users: int
    memory_seconds: float  # the memory run: one long stretch of half load
    http_seconds: float  # each HTTP mode, each round
    retention_events: int  # retention_drop_day_s: events in the day dropped
    dispatch_users: int  # dispatch_deliveries_per_s: users with one message each in the outbox
    cost_seconds: float  # each pass of the cost counters offers load this long
    cost_settle_s: float  # and waits this long for PostgreSQL's counters before reading them
    river_seconds: float  # peer_river_jobs_per_s: each `river bench` round this long (0: skipped)
    http_concurrency: int = 64
    http_batch: int = 50  # events per batched POST /v1/events
    default_window_ms: int = DEFAULT_BATCH_WINDOW_MS
    small_window_ms: int = SMALL_WINDOW_MS
    # --latency-curve: more latency rounds, each at this share of e2e_events_per_s (printed, no figures)
    latency_curve: tuple[float, ...] = ()


FULL = Plan(
    name="full",
    rounds=3,
    partitions=12,
    users=1000,
    raw_events=100_000,
    record_events=50_000,
    e2e_seconds=8.0,
    # A cap, not a count: the search stops at the first round the workers do not keep up
    # with (two or three rounds from the record rate). Six stopped it below saturation when it
    # started low (--only e2e without record: 1,000 events/s; single-event runs from the e2e
    # runs rate), and the counted rounds then measured an offer, not a capacity.
    search_rounds=12,
    latency_seconds=10.0,
    memory_users=10_000,
    memory_seconds=75.0,
    http_seconds=4.0,
    retention_events=1_000_000,
    dispatch_users=20_000,
    cost_seconds=10.0,
    cost_settle_s=11.0,
    river_seconds=15.0,
)

QUICK = Plan(
    name="quick",
    rounds=1,
    partitions=12,
    users=1000,
    raw_events=5_000,
    record_events=5_000,
    e2e_seconds=2.0,
    search_rounds=1,
    latency_seconds=2.5,
    memory_users=10_000,
    memory_seconds=6.0,
    http_seconds=1.0,
    retention_events=20_000,
    dispatch_users=500,
    cost_seconds=1.0,
    cost_settle_s=1.0,
    # River's CLI is a Go build (minutes on a fresh machine) and its figure is a peer's, not
    # vigil's: the smoke run skips it.
    river_seconds=0.0,
)
