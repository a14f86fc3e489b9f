"""Settings of `vigil scheduler`."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, ValidationInfo, field_validator

from vigil.ledger.retention import DEFAULT_DEDUP_WINDOW_DAYS
from vigil.scheduler.timing import DEFAULT_EACH_CAP, DEFAULT_GRACE
from vigil.settings import DEFAULT_SCHEDULER_METRICS_PORT, CommonSettings

# One second keeps a timer's lateness under a second or so while costing one indexed
# query per second per replica when nothing is due.
DEFAULT_TICK_S = 1.0
# Rows locked per transaction: large enough that a backlog of thousands drains in a few
# seconds, small enough that one broker round trip per batch stays well under the
# statement timeout and a crash re-produces little.
DEFAULT_BATCH_SIZE = 200
# Finished work is kept a month; a duplicate is recognised for a week (GitHub and Stripe
# retry webhooks for up to three days).
DEFAULT_RETENTION_DAYS = 30.0
# An escalated approval asks again and waits this long for the next deadline (and asks again).
DEFAULT_ESCALATE_AFTER_S = 3600
# A pass idle this long inside its transaction is a frozen or cut-off scheduler (a stopped
# VM, a partition: its connection never closes, so its locks never go): PostgreSQL ends its
# session and another replica takes the batch. A live pass is idle while it plans (well
# under a second for a batch) and while it waits for the broker (VIGIL_PRODUCE_TIMEOUT_S).
DEFAULT_PASS_IDLE_S = 60
# What a pass needs besides the broker's wait: the send's own extra second, and planning.
PASS_IDLE_OVER_PRODUCE_S = 5


class SchedulerSettings(CommonSettings):
    service_name: ClassVar[str] = "scheduler"

    scheduler_port: int = Field(
        DEFAULT_SCHEDULER_METRICS_PORT,
        ge=1,
        le=65535,
        description="Port of the scheduler's /healthz, /readyz and /metrics.",
    )
    scheduler_tick_s: float = Field(
        DEFAULT_TICK_S,
        gt=0,
        le=60,
        description="Seconds between scheduler passes when nothing is due (a backlog is drained without waiting).",
    )
    scheduler_batch_size: int = Field(
        DEFAULT_BATCH_SIZE,
        ge=1,
        le=10_000,
        description="Due timers locked, produced and committed per transaction.",
    )
    scheduler_grace_s: int = Field(
        DEFAULT_GRACE,
        ge=0,
        le=86_400,
        description="Lateness up to this many seconds counts as on time (the scheduler's own polling, not an outage): "
        "`skip` timers still fire and `max_lateness` never suppresses such an occurrence. At least the tick.",
    )
    scheduler_each_cap: int = Field(
        DEFAULT_EACH_CAP,
        ge=1,
        le=10_000,
        description="Most events one `each` timer fires in one pass after an outage"
        " (the latest ones; older are skipped).",
    )
    scheduler_escalate_after_s: int = Field(
        DEFAULT_ESCALATE_AFTER_S,
        ge=1,
        le=30 * 86_400,
        description="An approval whose policy is `escalate` is asked again at each deadline with a new deadline this "
        "many seconds later, until answered or denied by an operator (`vigil approvals deny`).",
    )
    retention_days: float = Field(
        DEFAULT_RETENTION_DAYS,
        ge=0,
        le=3650,
        description="Finished events, delivered or dead outbox messages, their runs and done timers are deleted "
        "this many days after they finished (the scheduler prunes hourly). 0 keeps everything. At least the dedup "
        "window.",
    )
    dedup_window_days: float = Field(
        DEFAULT_DEDUP_WINDOW_DAYS,
        gt=0,
        le=3650,
        description="A redelivered or retried event is recognised as a duplicate at least this long after it was "
        "recorded (longer than any webhook provider retries); retention may not delete its key sooner.",
    )
    dream_after_sessions: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Dreaming: a user's memory is reviewed (a background task with the memory tool only) once they "
        'have had this many new sessions since their last review. 0: never (docs/agent.md, "Dreaming").',
    )
    dream_check_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Seconds between the scheduler's looks for users due a memory review (with "
        "VIGIL_DREAM_AFTER_SESSIONS set).",
    )
    dream_token_budget: int = Field(
        20_000, ge=1, le=10_000_000, description="Most input+output tokens one memory review may use."
    )
    scheduler_pass_idle_s: int = Field(
        DEFAULT_PASS_IDLE_S,
        ge=1,
        le=3600,
        description="A pass whose transaction stays idle this long (a frozen or cut-off scheduler still holding its "
        "locked timers) is ended by PostgreSQL (idle_in_transaction_session_timeout) and its timers go to another "
        f"replica. At least VIGIL_PRODUCE_TIMEOUT_S + {PASS_IDLE_OVER_PRODUCE_S}.",
    )
    scheduler_crash_after_produce: bool = Field(
        False,
        description="Test hook: SIGKILL the scheduler after the broker acknowledged a pass's events and before the "
        "ledger commit (the crash the event keys make harmless). Never set in production.",
    )

    @field_validator("scheduler_grace_s")
    @classmethod
    def _grace_covers_tick(cls, value: int, info: ValidationInfo) -> int:
        tick = info.data.get("scheduler_tick_s")
        if tick is not None and value < tick:
            # Otherwise a timer found one tick late would count as missed, and `skip`
            # timers would drop occurrences depending on the tick's phase.
            raise ValueError(f"must be at least VIGIL_SCHEDULER_TICK_S ({tick:g} s)")
        return value

    @field_validator("scheduler_pass_idle_s")
    @classmethod
    def _idle_covers_the_broker_wait(cls, value: int, info: ValidationInfo) -> int:
        produce = info.data.get("produce_timeout_s")
        if produce is not None and value < produce + PASS_IDLE_OVER_PRODUCE_S:
            # Otherwise a pass waiting out a slow broker would be ended while still live.
            raise ValueError(f"must be at least VIGIL_PRODUCE_TIMEOUT_S + {PASS_IDLE_OVER_PRODUCE_S} s")
        return value

    @field_validator("dedup_window_days")
    @classmethod
    def _retention_keeps_the_window(cls, value: float, info: ValidationInfo) -> float:
        retention = info.data.get("retention_days")
        if retention and retention < value:
            # Deleting an event deletes its dedup key: a retry after that would run again.
            raise ValueError(f"VIGIL_RETENTION_DAYS ({retention:g}) must be at least the dedup window ({value:g} days)")
        return value
