"""The agent's Prometheus metrics (exposed on the worker's /metrics).

Labels take bounded values only: a result class, a token kind, a tool name from the
registry, a decision, a budget name. Never a user id, a session or a request id.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

MODEL_REQUESTS = Counter(
    "vigil_model_requests_total",
    "Model API calls by result: ok, rate_limited (429), overloaded (529), server_error (5xx), "
    "connection_error, client_error (4xx), other_error, cancelled (the run was cancelled mid-call; "
    "the request may still be billed).",
    ["result"],
)
MODEL_SECONDS = Histogram(
    "vigil_model_request_seconds",
    "Duration of one model API call, failed ones included.",
    buckets=(0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120),
)
MODEL_TOKENS = Counter(
    "vigil_model_tokens_total",
    "Tokens billed by the model API, by agent profile (default: the VIGIL_* settings) and kind: input, output, "
    "cache_read, cache_write.",
    ["profile", "kind"],
)
BUDGET_EXHAUSTED = Counter(
    "vigil_budget_exhausted_total",
    "Runs not started because the user's daily token budget was spent, by agent profile.",
    ["profile"],
)
BUDGET_TOKENS = Gauge(
    "vigil_budget_tokens",
    "Billed tokens each user of the agent profile may spend per UTC day (0: no limit), as this worker last "
    "read it (the default profile: VIGIL_USER_DAILY_TOKENS).",
    ["profile"],
)
SYNC_TASK_ROWS_UNWRITTEN = Counter(
    "vigil_sync_task_rows_unwritten_total",
    "Writes of a sync sub-agent's task row (its start or its end) the ledger did not take: the child ran "
    "anyway (the row is best effort).",
)
TOOL_CALLS = Counter(
    "vigil_tool_calls_total",
    "Tool calls the model made, by tool and what happened: ran, error (refused or failed), "
    "blocked (auto-mode policy), denied (permission deny), deferred (waits for approval), "
    "approved, refused_on_resume (approved but arguments or permission changed), declined (no or expired).",
    ["tool", "decision"],
)
APPROVALS_REQUESTED = Counter(
    "vigil_approvals_requested_total",
    "Approval questions sent, by tool and kind: ask (first time), escalate (asked again, louder).",
    ["tool", "kind"],
)
AUTO_FALLBACKS = Counter(
    "vigil_auto_mode_fallbacks_total",
    "Sessions whose auto mode fell back to asking after too many blocks.",
)
BUDGET_STOPS = Counter(
    "vigil_agent_budget_stops_total",
    "Runs stopped early by a budget: turns, tokens or wall_time.",
    ["budget"],
)
SESSIONS_CLOSED = Counter(
    "vigil_sessions_closed_total",
    "Sessions closed past the size budget (the next run starts fresh from memory).",
)
EVENTS_MID_RUN = Counter(
    "vigil_agent_mid_run_events_total",
    "Events claimed during a run, by what the run did with them: fold or interrupt.",
    ["policy"],
)

# Every bounded label value starts at zero (tool names are per deployment and appear on use).
# The per-call ones are kept bound: a labels() lookup per model call and token kind was a
# measurable share of a model-bound run's CPU.
MODEL_RESULTS = (
    "ok",
    "rate_limited",
    "overloaded",
    "server_error",
    "connection_error",
    "client_error",
    "other_error",
    "cancelled",
)
MODEL_REQUESTS_BY_RESULT = {result: MODEL_REQUESTS.labels(result) for result in MODEL_RESULTS}
TOKEN_KINDS = ("input", "output", "cache_read", "cache_write")
# Children by (profile, kind), made at first use: as many profiles as the ledger holds.
_TOKENS: dict[tuple[str, str], Any] = {("default", kind): MODEL_TOKENS.labels("default", kind) for kind in TOKEN_KINDS}
BUDGET_EXHAUSTED.labels("default")


def model_tokens(profile: str, kind: str) -> Any:
    """The ``vigil_model_tokens_total`` child of ``profile`` and ``kind``."""
    child = _TOKENS.get((profile, kind))
    if child is None:
        child = _TOKENS[profile, kind] = MODEL_TOKENS.labels(profile, kind)
    return child


for _budget in ("turns", "tokens", "wall_time"):
    BUDGET_STOPS.labels(_budget)
for _policy in ("fold", "interrupt"):
    EVENTS_MID_RUN.labels(_policy)

# Durable runs (vigil.agent.journal): what replays did not do again.
REPLAYED_STEPS_TOTAL = Counter(
    "vigil_replayed_steps_total",
    "Journaled steps a replayed run took from its journal instead of doing them again, by kind: "
    "model (an answer not requested again), call (an action call not executed again), in_doubt "
    "(an action call executed again with the same idempotency key: its outcome was never recorded).",
    ["kind"],
)
REPLAYED_STEPS = {kind: REPLAYED_STEPS_TOTAL.labels(kind) for kind in ("model", "call", "in_doubt")}
REPLAY_SAVED_TOKENS = Counter(
    "vigil_replay_saved_tokens_total",
    "Model tokens (input, output and cache, as billed) of journaled answers that replays did not request again.",
)
RUN_REPLAYS = Counter(
    "vigil_run_replays_total",
    "Runs that found a journal when they started, by what became of it: replayed (taken up where "
    "it stopped), discarded (its events could not all be claimed again: it started over with a new "
    "key), alone (a batch's journal on the lone last attempt of its first event, the batch having lost its "
    "worker only in company: the whole batch replayed with nothing else in flight, uncounted, once), isolated "
    "(such a batch that crashed alone: its first event ran alone afresh, claim rule 3), stepped_back (another "
    "run's journal, the user's run in progress, due its lone last attempt: the claim was released so that "
    "attempt runs first, alone), diverged (the run did "
    "not take a journaled step, e.g. the agent changed: it went on live "
    "from there under new step numbers, the steps before kept as facts).",
    ["reason"],
)
for _reason in ("replayed", "discarded", "alone", "isolated", "stepped_back", "diverged"):
    RUN_REPLAYS.labels(_reason)

REPLAYED_ACROSS = Counter(
    "vigil_runs_replayed_across_versions_total",
    "Replayed runs whose journal's start recorded another version than this worker would start "
    "them with now, by what changed: profile (the user's assigned version), model, tools (a tool of "
    "the recorded set gone or at another version), vigil. The replay keeps the recorded profile "
    "version and model either way.",
    ["changed"],
)
for _changed in ("profile", "model", "tools", "vigil"):
    REPLAYED_ACROSS.labels(_changed)

RUNS_UPGRADED = Counter(
    "vigil_runs_upgraded_total",
    "Replayed runs that went on under a newer version of their profile than their journal's start "
    "recorded, because an operator moved them (`vigil runs upgrade`): their journaled steps stayed facts, "
    "what they had not done yet ran on the new version.",
    ["profile"],
)

FLEET_WAITS_TOTAL = Counter(
    "vigil_model_fleet_waits_total",
    "Model calls that waited at the fleet's gate, by reason: backoff (the shared 429/529 back-off "
    "another worker or this one was told), slot (every VIGIL_MODEL_FLEET_CONCURRENCY slot held), "
    "ledger_error (the gate's bookkeeping unreachable: the call went ahead).",
    ["reason"],
)
FLEET_WAITS = {reason: FLEET_WAITS_TOTAL.labels(reason) for reason in ("backoff", "slot", "ledger_error")}
FLEET_WAIT_SECONDS = Histogram(
    "vigil_model_fleet_wait_seconds",
    "How long a model call waited at the fleet's gate (shared back-off or a free slot).",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
SCREENED = Counter(
    "vigil_screened_total",
    "Untrusted content screened before the model read it (events from sources other than chat, "
    "timers, approvals and tasks; action tool outputs), by verdict: clean, flagged (quarantined).",
    ["verdict"],
)
CLASSIFIER_VERDICTS = Counter(
    "vigil_auto_classifier_verdicts_total",
    "Auto mode's risk classifier on calls the per-tool rule would run, by verdict: safe, risky "
    "(blocked), failed (error, timeout or an answer out of form: the call asks the person).",
    ["verdict"],
)

MCP_SERVER_UP = Gauge(
    "vigil_mcp_server_up",
    "Is each MCP server of VIGIL_MCP_SERVERS answering this worker (its last listing or call got an answer: 1; "
    "it could not be listed or a call lost the connection: 0)?",
    ["server"],
)
MCP_SERVER_TOOLS = Gauge(
    "vigil_mcp_server_tools",
    "Tools each MCP server offered at its last listing by this worker (0 while it could not be listed).",
    ["server"],
)
