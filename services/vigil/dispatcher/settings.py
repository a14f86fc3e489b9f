"""Settings of `vigil dispatcher`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from vigil.settings import DEFAULT_DISPATCHER_METRICS_PORT, CommonSettings

# The source scenario's rule: a person hears from their agent at most once an hour unless
# something is urgent.
DEFAULT_OUTBOX_GAP_S = 3600
# Attention earned: from a few minutes between messages for an engaged person to one an hour.
DEFAULT_ATTENTION_MIN_GAP_S = 300
DEFAULT_ATTENTION_MAX_GAP_S = 3600
DEFAULT_ATTENTION_REPLY_WINDOW_S = 1800
# With the backoff below, twelve attempts span about five hours: long enough to ride out a
# receiver's deploy or an afternoon outage, short enough that an operator still cares.
DEFAULT_MAX_ATTEMPTS = 12
DEFAULT_BACKOFF_BASE_S = 30.0
DEFAULT_BACKOFF_CAP_S = 3600.0
# An idle dispatcher costs one indexed query per second per replica; a message that becomes
# due waits at most this long.
DEFAULT_POLL_INTERVAL_S = 1.0
# Users locked per claim transaction, and the most deliveries one dispatcher has claimed and
# not yet sent: the locks are held only while delivery ids are fixed (milliseconds), and the
# sends run in parallel. With the sends at once they set a dispatcher's rate: 100 and 16
# relayed about 1,950 deliveries/s to Kafka, 200 and 64 about 4,600 (`make bench`,
# dispatch_deliveries_per_s).
DEFAULT_BATCH_USERS = 200
DEFAULT_CONCURRENCY = 64
# Standard Webhooks receivers are expected to answer within seconds; a receiver that takes
# longer is treated as down and retried, not waited on.
DEFAULT_HTTP_TIMEOUT_S = 10.0
# A send not finished after this long is presumed lost with its dispatcher (SIGKILL, a node
# gone) and is re-sent by another one under the same delivery id.
DEFAULT_LEASE_S = 120.0
# Urgent messages bypass the gap; past this many bypasses a day (UTC) they wait like others.
DEFAULT_URGENT_DAILY_CAP = 4


class DispatcherSettings(CommonSettings):
    service_name: ClassVar[str] = "dispatcher"

    dispatcher_port: int = Field(
        DEFAULT_DISPATCHER_METRICS_PORT,
        ge=1,
        le=65535,
        description="Port of the dispatcher's /healthz, /readyz and /metrics.",
    )
    outbox_gap: int = Field(
        DEFAULT_OUTBOX_GAP_S,
        ge=0,
        le=30 * 86_400,
        description="Seconds between two deliveries to one user; messages written inside the gap are held and joined "
        "into the next delivery. Per user: `vigil channels set USER ... --gap`.",
    )
    attention_adapt: bool = Field(
        False,
        description="Attention earned: each user's gap adapts at each new delivery, halved when they replied to the "
        "previous one within VIGIL_ATTENTION_REPLY_WINDOW_S, doubled when not, starting at the quiet end "
        "(VIGIL_ATTENTION_MAX_GAP_S). A channel's `--gap` or `vigil users attention --gap` wins.",
    )
    attention_min_gap_s: int = Field(
        DEFAULT_ATTENTION_MIN_GAP_S, ge=0, le=30 * 86_400, description="The shortest gap attention can earn."
    )
    attention_max_gap_s: int = Field(
        DEFAULT_ATTENTION_MAX_GAP_S,
        ge=0,
        le=30 * 86_400,
        description="The longest gap, where every user starts (the quiet end).",
    )
    attention_reply_window_s: int = Field(
        DEFAULT_ATTENTION_REPLY_WINDOW_S,
        ge=1,
        le=7 * 86_400,
        description="A chat message this soon after a delivery counts as a reply to it.",
    )
    urgent_daily_cap: int = Field(
        DEFAULT_URGENT_DAILY_CAP,
        ge=0,
        le=10_000,
        description="Urgent deliveries per user and UTC day that may bypass the gap (0: urgent messages wait too). "
        "Per user: `vigil channels set USER ... --urgent-cap`.",
    )
    delivery_max_attempts: int = Field(
        DEFAULT_MAX_ATTEMPTS,
        ge=1,
        le=1000,
        description="Attempts a delivery gets before it is dead (kept, listed, counted).",
    )
    delivery_backoff_base_s: float = Field(
        DEFAULT_BACKOFF_BASE_S,
        gt=0,
        le=86_400,
        description="Wait after a delivery's first failed attempt; doubles per attempt.",
    )
    delivery_backoff_cap_s: float = Field(
        DEFAULT_BACKOFF_CAP_S,
        gt=0,
        le=7 * 86_400,
        description="Longest wait between delivery attempts (a receiver's longer Retry-After is still honoured).",
    )
    delivery_http_timeout_s: float = Field(
        DEFAULT_HTTP_TIMEOUT_S,
        gt=0,
        le=300,
        description="Webhook channel: seconds a receiver gets to answer before the attempt fails.",
    )
    delivery_lease_s: float = Field(
        DEFAULT_LEASE_S,
        gt=0,
        le=86_400,
        description="A send not finished after this many seconds is presumed lost with its dispatcher and re-sent by "
        "another under the same delivery id. Longer than the HTTP and produce timeouts.",
    )
    dispatcher_poll_interval_s: float = Field(
        DEFAULT_POLL_INTERVAL_S, gt=0, le=60, description="Seconds between outbox passes when nothing was due."
    )
    dispatcher_batch_users: int = Field(
        DEFAULT_BATCH_USERS, ge=1, le=10_000, description="Users locked and given a delivery per claim transaction."
    )
    dispatcher_concurrency: int = Field(
        DEFAULT_CONCURRENCY, ge=1, le=1000, description="Deliveries one dispatcher sends at once."
    )
    dispatcher_clock_file: Path | None = Field(
        None,
        description="Test hook: read the current time (Unix seconds) from this file instead of the system clock, so "
        "tests can move a dispatcher through hours. Never set in production.",
    )
    dispatcher_crash_after_send: bool = Field(
        False,
        description="Test hook: SIGKILL the dispatcher after a channel accepted a delivery and before the ledger "
        "commit (the crash the delivery id makes harmless). Never set in production.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> DispatcherSettings:
        if self.delivery_backoff_cap_s < self.delivery_backoff_base_s:
            raise ValueError("VIGIL_DELIVERY_BACKOFF_CAP_S must be at least VIGIL_DELIVERY_BACKOFF_BASE_S")
        if self.attention_min_gap_s > self.attention_max_gap_s:
            raise ValueError("VIGIL_ATTENTION_MIN_GAP_S must be at most VIGIL_ATTENTION_MAX_GAP_S")
        # At most `batch_users` claimed deliveries wait or are being sent (the loop claims only
        # into that room), `concurrency` at a time, each send bounded by its timeout: the
        # last one claimed may finish this long after its claim.
        rounds = math.ceil(self.dispatcher_batch_users / self.dispatcher_concurrency)
        slowest_batch = rounds * max(self.delivery_http_timeout_s, self.produce_timeout_s)
        if self.delivery_lease_s <= slowest_batch:
            # Otherwise a send still waiting for its answer would be re-sent by another
            # dispatcher: a duplicate on every slow receiver, not only after a crash.
            raise ValueError(
                f"VIGIL_DELIVERY_LEASE_S ({self.delivery_lease_s:g}) must be longer than a claimed batch may take to "
                f"send ({slowest_batch:g}s: VIGIL_DISPATCHER_BATCH_USERS / VIGIL_DISPATCHER_CONCURRENCY rounds of "
                "VIGIL_DELIVERY_HTTP_TIMEOUT_S or VIGIL_PRODUCE_TIMEOUT_S)"
            )
        if self.dispatcher_clock_file is not None:
            try:
                value = float(self.dispatcher_clock_file.read_text().strip())
            except (OSError, ValueError) as exc:
                raise ValueError(f"VIGIL_DISPATCHER_CLOCK_FILE: cannot read Unix seconds from it ({exc})") from None
            if not math.isfinite(value):
                raise ValueError("VIGIL_DISPATCHER_CLOCK_FILE: not a finite number of seconds")
        return self
