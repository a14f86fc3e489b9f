"""Write vigil.json, the Grafana dashboard, from the panel lists below.

    python deploy/grafana/generate.py          # rewrite the dashboard
    python deploy/grafana/generate.py --check  # exit 1 if vigil.json is out of date

Plain dictionaries rather than a dashboard library: the dashboard is timeseries panels with
PromQL targets, and the JSON model of those is small and stable. Heavy queries read the
recording rules of deploy/prometheus/vigil.rules.yaml (`vigil:*`); ledger-wide gauges use
max() (every replica reports the same value). tests/test_observability_live.py evaluates
every target here against a real Prometheus scraping real services and fails on any that
returns no series.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "vigil.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH = 24
# The `shard` variable's values: every ledger shard a scheduler reports on.
SHARD_VALUES = "label_values(vigil_scheduler_shard_up, shard)"


def panel(title: str, *targets: tuple[str, str], unit: str = "short", description: str = "") -> dict:
    """A timeseries panel; each target is (PromQL, legend)."""
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


OVERVIEW = [
    panel(
        "Ingest requests by route and status",
        ("sum by (route, status) (vigil:ingest_requests:rate5m)", "{{route}} {{status}}"),
        unit="reqps",
    ),
    panel(
        "Ingest latency by route (p50, p99)",
        ("vigil:ingest_request_duration_seconds:p99_5m", "p99 {{route}}"),
        ("vigil:ingest_request_duration_seconds:p50_5m", "p50 {{route}}"),
        unit="s",
    ),
    panel("Consumer lag by partition", ("vigil:consumer_lag_messages:max", "partition {{partition}}")),
    panel(
        "Pending events and the oldest one's age",
        ("vigil:pending_events:max", "pending"),
        ("vigil:oldest_pending_event_age_seconds:max", "oldest pending (s)"),
        description="Age of the oldest event waiting for a run, all users"
        " (max over workers: every worker reads the ledger).",
    ),
    panel("Runs by outcome", ("vigil:runs:rate5m", "{{outcome}}"), unit="ops"),
    panel(
        "Run duration (p50, p99)",
        ("vigil:run_duration_seconds:p50_5m", "p50"),
        ("vigil:run_duration_seconds:p99_5m", "p99"),
        unit="s",
    ),
    panel("Model tokens by kind", ("sum by (kind) (vigil:model_tokens:rate5m)", "{{kind}}"), unit="short"),
    panel(
        "Model calls by result (overloads, rate limits, errors)",
        ("vigil:model_requests:rate5m", "{{result}}"),
        unit="reqps",
    ),
    panel(
        "Outbox backlog",
        ("sum by (status) (vigil:outbox_backlog_messages:max)", "{{status}}"),
        description="Undelivered outbox messages, all ledger shards (max over dispatchers: every dispatcher"
        " reads the ledger; the shards row has them per shard).",
    ),
    panel("Outbox oldest undelivered", ("max(vigil:outbox_oldest_age_seconds:max)", "oldest"), unit="s"),
    panel("Deliveries by channel and result", ("vigil:deliveries:rate5m", "{{channel}} {{result}}"), unit="ops"),
    panel(
        "Dead events and dead deliveries (last hour)",
        ("sum(increase(vigil_events_dead_total[1h]))", "dead events"),
        ("sum by (channel, reason) (increase(vigil_dead_deliveries_total[1h]))", "dead {{channel}} {{reason}}"),
    ),
    panel(
        "Timers due and oldest due",
        ("sum(vigil:timer_due_backlog_timers:max)", "due timers"),
        ("max(vigil:timer_oldest_due_age_seconds:max)", "oldest due (s)"),
    ),
    panel("Timer lateness p99 by kind", ("vigil:timer_lateness_seconds:p99_10m", "{{kind}}"), unit="s"),
    panel("Targets up", ('sum by (job) (up{job=~"vigil-.+"})', "{{job}}")),
    panel(
        "Partitions held",
        ("vigil:partition_epochs_held:sum", "held"),
        ("max(vigil_events_topic_partitions)", "in topic"),
    ),
]

INGEST = [
    panel("Events acknowledged by entry point", ("vigil:ingest_events_produced:rate5m", "{{via}}"), unit="ops"),
    panel("Broker acknowledgement p99", ("vigil:ingest_produce_duration_seconds:p99_5m", "{{via}}"), unit="s"),
    panel(
        "Produce failures (503s)",
        ("sum by (via) (rate(vigil_ingest_produce_failures_total[5m]))", "{{via}}"),
        unit="ops",
    ),
    panel(
        "Webhook signature failures",
        ("sum by (provider, reason) (rate(vigil_webhook_signature_failures_total[5m]))", "{{provider}} {{reason}}"),
        unit="ops",
    ),
    panel(
        "Requests by method and status",
        ("sum by (method, status) (vigil:ingest_requests:rate5m)", "{{method}} {{status}}"),
        unit="reqps",
    ),
]

WORKER = [
    panel(
        "Events consumed and recorded",
        ("sum(rate(vigil_events_consumed_total[5m]))", "consumed"),
        ("vigil:events_recorded:rate5m", "recorded {{result}}"),
        unit="ops",
    ),
    panel(
        "Claims by attempt",
        ("sum by (attempt) (rate(vigil_claim_attempts_total[5m]))", "attempt {{attempt}}"),
        unit="ops",
    ),
    panel(
        "Events per run (p50, p99)",
        ("histogram_quantile(0.5, sum by (le) (rate(vigil_claim_batch_events_bucket[5m])))", "p50"),
        ("histogram_quantile(0.99, sum by (le) (rate(vigil_claim_batch_events_bucket[5m])))", "p99"),
    ),
    panel("Runs in flight by worker", ("sum by (instance) (vigil_runs_in_flight)", "{{instance}}")),
    panel("Partitions held by worker", ("sum by (instance) (vigil_partition_epochs_held)", "{{instance}}")),
    panel(
        "Event loop lag p90 by worker (runs queue for the interpreter)",
        (
            "histogram_quantile(0.9, sum by (instance, le) (rate(vigil_worker_event_loop_lag_seconds_bucket[5m])))",
            "{{instance}}",
        ),
        unit="s",
    ),
    panel(
        "Ledger step p99 (claim pass, group finish)",
        ("histogram_quantile(0.99, sum by (step, le) (rate(vigil_worker_ledger_seconds_bucket[5m])))", "{{step}}"),
        unit="s",
    ),
    panel(
        "Runs per finish transaction (p50)",
        ("histogram_quantile(0.5, sum by (le) (rate(vigil_finish_batch_runs_bucket[5m])))", "p50"),
    ),
    panel(
        "Fencing and recovery",
        ("sum(rate(vigil_stale_finishes_total[5m]))", "stale finishes"),
        ("sum(rate(vigil_claims_recovered_total[5m]))", "claims recovered"),
        ("sum(rate(vigil_claims_released_total[5m]))", "claims released"),
        ("sum(rate(vigil_lone_runs_total[5m]))", "lone runs"),
        ("sum(rate(vigil_revoke_runs_finished_total[5m]))", "runs finished in a revoke's grace"),
        unit="ops",
    ),
    panel(
        "Hand-over p99 (rebalances: runs finishing on the old owner; the new owner's takeover waiting)",
        (
            "histogram_quantile(0.99, sum by (instance, le) (rate(vigil_worker_handover_seconds_bucket[15m])))",
            "{{instance}} hand-over",
        ),
        (
            "histogram_quantile(0.99, sum by (instance, le) (rate(vigil_worker_handover_wait_seconds_bucket[15m])))",
            "{{instance}} takeover wait",
        ),
        (
            "histogram_quantile(0.99, sum by (instance, le) (rate(vigil_worker_revoke_seconds_bucket[15m])))",
            "{{instance}} revoke (recording paused)",
        ),
        unit="s",
    ),
    panel(
        "Undecodable messages",
        ("sum(rate(vigil_events_undecodable_total[5m]))", "to the dead-letter topic"),
        unit="ops",
    ),
    panel(
        "Events produced again to their user's home partition",
        ("sum(rate(vigil_events_rerouted_total[5m]))", "rerouted"),
        unit="ops",
        description="Read on a partition of another ledger shard than their user's (another producer's"
        " partitioner, a topic grown past VIGIL_PARTITIONS); always 0 on one shard.",
    ),
]

AGENT = [
    panel("Model call p99", ("vigil:model_request_seconds:p99_5m", "p99"), unit="s"),
    panel(
        "Tool calls by tool and decision",
        ("sum by (tool, decision) (rate(vigil_tool_calls_total[5m]))", "{{tool}} {{decision}}"),
        unit="ops",
    ),
    panel(
        "Approvals requested",
        ("sum by (tool, kind) (increase(vigil_approvals_requested_total[1h]))", "{{tool}} {{kind}}"),
    ),
    panel(
        "Budget stops, mid-run events, fallbacks, closed sessions",
        ("sum by (budget) (increase(vigil_agent_budget_stops_total[1h]))", "budget {{budget}}"),
        ("sum by (policy) (increase(vigil_agent_mid_run_events_total[1h]))", "mid-run {{policy}}"),
        ("sum(increase(vigil_auto_mode_fallbacks_total[1h]))", "auto-mode fallbacks"),
        ("sum(increase(vigil_sessions_closed_total[1h]))", "sessions closed"),
    ),
]

SCHEDULER = [
    panel(
        "Timer events by kind and catch-up",
        ("sum by (kind, catch_up) (rate(vigil_timer_events_total[5m]))", "{{kind}} {{catch_up}}"),
        unit="ops",
    ),
    panel(
        "Skipped occurrences",
        ("sum by (kind, catch_up) (increase(vigil_timer_skipped_occurrences_total[1h]))", "{{kind}} {{catch_up}}"),
    ),
    panel(
        "Pass duration p99",
        ("histogram_quantile(0.99, sum by (le) (rate(vigil_scheduler_pass_duration_seconds_bucket[5m])))", "p99"),
        unit="s",
    ),
    panel(
        "Pass failures and timers set aside",
        ("sum by (reason) (rate(vigil_scheduler_pass_failures_total[5m]))", "failed: {{reason}}"),
        ("sum(rate(vigil_timer_set_aside_total[5m]))", "set aside"),
        unit="ops",
    ),
    panel(
        "Approval deadlines by outcome",
        ("sum by (outcome) (increase(vigil_approval_expiries_total[1h]))", "{{outcome}}"),
    ),
    panel("Rows pruned by retention", ("sum by (table) (increase(vigil_ledger_pruned_rows_total[1h]))", "{{table}}")),
]

DISPATCHER = [
    panel(
        "Delivery latency p99 by channel (pacing included)",
        ("vigil:delivery_latency_seconds:p99_10m", "{{channel}}"),
        unit="s",
    ),
    panel(
        "Retries by channel and reason",
        ("sum by (channel, reason) (rate(vigil_delivery_retries_total[5m]))", "{{channel}} {{reason}}"),
        unit="ops",
    ),
    panel(
        "Messages joined per delivery (p50)",
        ("histogram_quantile(0.5, sum by (le) (rate(vigil_delivery_joined_messages_bucket[10m])))", "p50"),
    ),
    panel(
        "Urgent bypasses, superseded outcomes, claim conflicts",
        ("sum(rate(vigil_urgent_bypasses_total[5m]))", "urgent bypasses"),
        ("sum by (channel) (rate(vigil_delivery_superseded_total[5m]))", "superseded {{channel}}"),
        ("sum(rate(vigil_dispatcher_claim_conflicts_total[5m]))", "claim conflicts"),
        unit="ops",
    ),
    panel(
        "Seconds since each dispatcher's last pass",
        ("time() - max by (instance) (vigil_dispatcher_last_pass_timestamp_seconds)", "{{instance}}"),
        unit="s",
    ),
    panel(
        "Pause between sweeps (the longest a held message past its gap waits)",
        ("max by (instance) (vigil_dispatcher_sweep_pause_seconds)", "{{instance}}"),
        unit="s",
    ),
]

# The ledger shards picked in the dashboard's `shard` variable (all of them by default).
SHARD = 'shard=~"$shard"'


def by_shard(title: str, recorded: str, unit: str = "short", description: str = "") -> dict:
    """A panel of one recording rule kept by shard, for the shards the variable picks."""
    return panel(title, (f"{recorded}{{{SHARD}}}", "shard {{shard}}"), unit=unit, description=description)


SHARDS = [
    panel(
        "Shards answering (scheduler, dispatcher)",
        (f"max by (shard) (vigil_scheduler_shard_up{{{SHARD}}})", "scheduler shard {{shard}}"),
        (f"max by (shard) (vigil_dispatcher_shard_up{{{SHARD}}})", "dispatcher shard {{shard}}"),
        description="1 while some replica's passes (scheduler) or loops (dispatcher) get through on the shard;"
        " 0 for 3 minutes fires VigilLedgerShardDown. The other shards are served meanwhile.",
    ),
    by_shard(
        "Timers due by shard",
        "vigil:timer_due_backlog_timers:max",
        description="Live timers past their due time that no pass has handled yet.",
    ),
    by_shard(
        "Oldest due timer by shard",
        "vigil:timer_oldest_due_age_seconds:max",
        unit="s",
        description="Over 2 minutes for 5 fires VigilSchedulerLate for the shard.",
    ),
    panel(
        "Outbox backlog by shard",
        (f"vigil:outbox_backlog_messages:max{{{SHARD}}}", "shard {{shard}} {{status}}"),
    ),
    by_shard(
        "Outbox oldest undelivered by shard",
        "vigil:outbox_oldest_age_seconds:max",
        unit="s",
        description="Over 3 hours for 15 minutes fires VigilOutboxStuck for the shard.",
    ),
    panel(
        "Partitions held by shard (all workers)",
        (f"sum by (shard) (vigil_worker_shard_partitions{{{SHARD}}})", "shard {{shard}}"),
        description="The events topic's partitions the workers own, by the ledger shard holding their users.",
    ),
    panel(
        "Seconds since the dispatcher's last pass, by shard",
        (f"time() - max by (shard) (vigil_dispatcher_last_pass_timestamp_seconds{{{SHARD}}})", "shard {{shard}}"),
        unit="s",
    ),
]

# Billed as the provider bills, as daily budgets count: cache writes 1.25x, cache reads 0.1x.
BILLED_24H = (
    'sum by (profile) (increase(vigil_model_tokens_total{kind=~"input|output"}[1d]))'
    ' + 1.25 * sum by (profile) (increase(vigil_model_tokens_total{kind="cache_write"}[1d]))'
    ' + 0.1 * sum by (profile) (increase(vigil_model_tokens_total{kind="cache_read"}[1d]))'
)
# The budget is per user and day; the workers that ran the profile report the same value.
BUDGET = "max by (profile) (vigil_budget_tokens)"
BUDGETS = [
    panel(
        "Billed tokens by profile, last 24 hours",
        (BILLED_24H, "{{profile}}"),
        description="A profile's daily_tokens (or VIGIL_USER_DAILY_TOKENS) bounds each of its users per UTC"
        " day; `vigil profiles show NAME` has the bound.",
    ),
    panel(
        "Spend against budget: billed in 24 hours, in users' daily budgets",
        (f"({BILLED_24H}) / on (profile) ({BUDGET} > 0)", "{{profile}}"),
        unit="none",
        description="A profile's billed tokens of the last 24 hours divided by one user's daily budget: 1 is"
        " one user's whole day; near the number of its active users, they are all near their bound."
        " Profiles without a budget have no line.",
    ),
    panel(
        "Daily budget per user, by profile",
        (BUDGET, "{{profile}}"),
        description="vigil_budget_tokens: the bound each user of the profile has per UTC day, as the workers"
        " last read it (0: no limit; default: VIGIL_USER_DAILY_TOKENS).",
    ),
    panel(
        "Runs refused for a spent daily budget, by profile",
        ("sum by (profile) (increase(vigil_budget_exhausted_total[1h]))", "{{profile}}"),
        description="Each is a run whose events wait for the next UTC day (alert VigilBudgetExhausted).",
    ),
]

ROWS = [
    ("Overview", OVERVIEW, False),
    ("ledger shards (pick them in the shard variable)", SHARDS, True),
    ("ingest", INGEST, True),
    ("worker", WORKER, True),
    ("agent (in the worker)", AGENT, True),
    ("budgets (spend against budget, by profile)", BUDGETS, True),
    ("scheduler", SCHEDULER, True),
    ("dispatcher", DISPATCHER, True),
]


def dashboard() -> dict:
    panels, y, next_id = [], 0, 1
    for title, row_panels, collapsed in ROWS:
        row = {
            "type": "row",
            "title": title,
            "id": next_id,
            "collapsed": collapsed,
            "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y},
            "panels": [],
        }
        next_id += 1
        y += 1
        panels.append(row)
        for i, p in enumerate(row_panels):
            placed = {**p, "id": next_id, "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8}}
            next_id += 1
            (row["panels"] if collapsed else panels).append(placed)
        y += ((len(row_panels) + 2) // 3) * 8
    return {
        "uid": "vigil",
        "title": "vigil",
        "description": "vigil, an always-on agent runtime: overview first, then one row per service. "
        "Runbooks: docs/operations.md.",
        "tags": ["vigil"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "shard",
                    "label": "Ledger shard",
                    "type": "query",
                    "datasource": DS,
                    "definition": SHARD_VALUES,
                    "query": {"query": SHARD_VALUES, "refId": "shard"},
                    "refresh": 2,
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "sort": 3,
                    "current": {},
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def main(argv: list[str]) -> int:
    text = json.dumps(dashboard(), indent=2) + "\n"
    if "--check" in argv:
        if not DASHBOARD.exists() or DASHBOARD.read_text() != text:
            print(f"{DASHBOARD} is out of date: run python deploy/grafana/generate.py", file=sys.stderr)
            return 1
        return 0
    DASHBOARD.write_text(text)
    print(f"wrote {DASHBOARD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
