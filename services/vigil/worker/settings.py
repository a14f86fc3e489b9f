"""Settings of `vigil worker`."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from vigil.settings import DEFAULT_WORKER_METRICS_PORT, CommonSettings

DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_BATCH_MAX = 50
# Long enough that events arriving together (one poll batch, a webhook burst, a message and
# its edit) share a run; no longer, because every event waits it out. Messages a person types
# seconds apart are not a window's job: they go to the next run, or fold into the running one.
DEFAULT_BATCH_WINDOW_MS = 50
# Runs wait on the model API almost all the time (seconds per call, little CPU), so one
# process holds many; 429s from a rate limit are retried later without counting an attempt.
# The model-bound benchmark (docs/performance.md) bounds it: about 3-4 ms of worker CPU and
# 50 KB per run, so 1,000 runs of 5 s model calls take 0.6-0.8 of the one core a worker
# uses; more in flight only queues runs for that core. VIGIL_MODEL_MAX_CONNECTIONS follows.
DEFAULT_RUN_CONCURRENCY = 1000
# A pass's runs start when the pass ends, so its length is in every claimed event's latency;
# and a pass that takes fewer users per pass makes a loaded worker's runs take more events
# each. Each pass also costs its statements, so a bound caps the runs per second. Measured on
# the e2e bench (docs/performance.md, change 16): 200 against no bound, e2e events/s
# 16,875 -> 19,254 (7.4 events per run instead of 5.5), single-event runs 8,433 -> 7,833/s,
# worker CPU per single-event run 114 -> 126 us, the same p99 at a 14% higher half load; 100
# gave 20,408 events/s but single-event runs 6,667/s and 157 us per run.
DEFAULT_CLAIM_PASS_MAX = 200
# How long a crashed worker's users wait before another worker runs them (failover), about
# this plus a rebalance. librdkafka's heartbeats come from a background thread, so a busy run
# loop or a slow ledger never misses one: 10 s rides out a GC pause or a short network blip
# and keeps failover under 15 s (librdkafka's default of 45 s made users wait nearly a minute).
DEFAULT_SESSION_TIMEOUT_MS = 10_000
# Five seconds inside Kubernetes' default 30 s termination grace, which leaves the kubelet
# room for the preStop sleep's end and the SIGKILL it sends at the grace's end.
DEFAULT_SHUTDOWN_GRACE_S = 25.0


class WorkerSettings(CommonSettings):
    service_name: ClassVar[str] = "worker"

    worker_port: int = Field(
        DEFAULT_WORKER_METRICS_PORT, ge=1, le=65535, description="Port of the worker's /healthz, /readyz and /metrics."
    )
    worker_group: str = Field("vigil-worker", min_length=1, description="Kafka consumer group of the workers.")
    shutdown_grace_s: float = Field(
        DEFAULT_SHUTDOWN_GRACE_S,
        ge=2,
        le=3600,
        description="Seconds from SIGTERM to exit: runs get all but the last ones (up to 10 s, kept for "
        "committing finishes and closing the consumer). Keep the pod's termination grace above it.",
    )
    agent: str = Field(
        "claude",
        pattern="^(echo|claude)$",
        description="Agent behind each run: `claude` (needs ANTHROPIC_API_KEY)"
        " or `echo` (repeats chat messages, no model).",
    )
    max_attempts: int = Field(
        DEFAULT_MAX_ATTEMPTS, ge=1, le=100, description="Claims an event gets before it is dead (counted at claim)."
    )
    transient_max_attempts: int = Field(
        20,
        ge=1,
        le=1000,
        description=(
            "Releases for model API overload (429/529/5xx) or a ledger lost mid-run an event gets"
            " before they count as attempts."
        ),
    )
    batch_max: int = Field(DEFAULT_BATCH_MAX, ge=1, le=1000, description="Most events one run takes.")
    batch_window_ms: int = Field(
        DEFAULT_BATCH_WINDOW_MS,
        ge=0,
        le=60_000,
        description="A run starts no sooner than this after the user's oldest pending event was recorded, "
        "so quick successive messages share one run.",
    )
    run_concurrency: int = Field(
        DEFAULT_RUN_CONCURRENCY, ge=1, le=10_000, description="Runs one worker process executes at once."
    )
    claim_pass_max: int = Field(
        DEFAULT_CLAIM_PASS_MAX,
        ge=1,
        le=10_000,
        description="Most runs one claim pass starts (a pass that fills it is followed by another at once). "
        "A pass's runs start when it ends, and shorter passes make a loaded worker's runs take more events "
        "each; each pass costs its statements, so the bound caps the runs per second. Against no bound, "
        "200 raised the events per second at saturation by 14% and lowered the peak single-event runs "
        "per second by 7%.",
    )
    run_timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="Wall time a run may take before it is cancelled as a failed attempt."
    )
    revoke_grace_s: float = Field(
        10.0,
        ge=0,
        le=120,
        description="On a rebalance, how long the runs of a partition taken from this worker may go on to finish "
        "and commit before they are cancelled and released to run again on the next owner: a hand-over, during "
        "which this worker goes on recording and the partition's next owner waits to take it over (0: cancel at "
        "once). At most half of VIGIL_KAFKA_MAX_POLL_INTERVAL_MS.",
    )
    handover: Literal["step", "finish"] = Field(
        "step",
        description="How a revoke or a shutdown hands a run in flight over: `step`, at its next step boundary "
        "(its model answer in flight is journaled first; the next owner replays the run and goes on), or `finish`, "
        "after the run's end and finish. Either way, within VIGIL_REVOKE_GRACE_S or VIGIL_SHUTDOWN_GRACE_S; what "
        "is still running then is cancelled and replayed. `step` needs VIGIL_RUN_JOURNAL (without it: `finish`).",
    )
    lone_drain_s: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="An event lost with a crashed worker runs its last attempt alone: the worker waits this long "
        "for its runs in flight to finish, then cancels and releases the rest (their attempts given back).",
    )
    backoff_base_s: float = Field(
        2.0, gt=0, le=3600, description="First retry backoff; doubles per attempt, with jitter."
    )
    backoff_cap_s: float = Field(300.0, gt=0, le=86_400, description="Longest retry backoff.")
    scan_interval_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="How often the worker looks in the ledger for work nobody woke it for "
        "(other partitions' consumers, ended backoffs, recovered claims).",
    )
    heal_interval_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="How often a worker releases claims at its own epochs that no run of its holds (a finish "
        "whose commit the ledger lost); also on assignment and after a finish commit that failed.",
    )
    finish_batch_max: int = Field(
        200, ge=1, le=5000, description="Most finished runs committed together in one ledger transaction."
    )
    finish_concurrency: int = Field(
        2,
        ge=1,
        le=16,
        description="Finish transactions a worker has in flight at once, each committing a group of finished runs: "
        "with two, the next group's statements overlap the last one's commit (each takes a ledger connection).",
    )
    poll_batch_max: int = Field(
        1000,
        ge=1,
        le=100_000,
        description="Most Kafka messages recorded per ledger insert (a backlog records faster in bigger ones:"
        " 4000 recorded 28% more events/s on the bench; batches at a steady load stay far smaller).",
    )
    kafka_session_timeout_ms: int = Field(
        DEFAULT_SESSION_TIMEOUT_MS,
        ge=1000,
        le=3_600_000,
        description="Consumer session timeout: how long a silent worker keeps its partitions, so about how long "
        "a crashed worker's users wait before another worker runs them (failover; see docs/faults.md). The "
        "worker heartbeats every tenth of it (at least 500 ms): each rebalance waits up to one heartbeat per member.",
    )
    kafka_max_poll_interval_ms: int = Field(
        300_000,
        ge=1000,
        le=86_400_000,
        description="Consumer max.poll.interval.ms (also the group's rebalance timeout). Runs and takeovers never "
        "block polling, so this only catches a hung poll loop; a takeover waits for the previous owner's "
        "hand-over at most half of this.",
    )
    db_pool_max: int = Field(8, ge=2, le=200, description="Ledger connections of the run loop.")
    # Background tasks (docs/tasks.md): any worker executes them, outside the one-run-per-user rule.
    task_concurrency: int = Field(
        16, ge=0, le=10_000, description="Background tasks one worker executes at once (0: this worker runs none)."
    )
    task_heartbeat_s: float = Field(
        5.0, gt=0, le=3600, description="How often a worker executing a task proves it alive, and sees a cancel."
    )
    run_journal: bool = Field(
        True,
        description="Journal every step of a Claude run (model answers, action calls) in the ledger, so a run "
        "taken over after a crash, a deploy's stop or a rebalance replays them instead of asking and acting again "
        '(docs/worker.md, "Durable runs"). Off: a retried run or task starts over, asks the model again and '
        "repeats every action call its earlier attempts made, under new idempotency keys (a key per attempt), so "
        "the systems it acts on cannot tell the repeat. Refused at start-up while the agent has tools that act "
        "(any action tool not marked read-only) unless VIGIL_RUN_JOURNAL_OFF_WITH_ACTIONS=accept.",
    )
    run_journal_off_with_actions: Literal["refuse", "accept"] = Field(
        "refuse",
        description="With VIGIL_RUN_JOURNAL=false and tools that act on the world: `refuse` stops the worker at "
        "start-up, naming them; `accept`, an operator's choice, runs them without a journal (a crash repeats "
        "their calls under new keys).",
    )
    task_stale_s: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="A running task whose heartbeat is older than this is taken back from its (presumed dead) "
        "holder: queued again, or lost once VIGIL_TASK_MAX_ATTEMPTS holders were. At least twice the heartbeat.",
    )
    task_timeout_s: float = Field(
        900.0, gt=0, le=7 * 86_400, description="A background task's deadline, from its creation: then timed_out."
    )
    task_max_attempts: int = Field(
        3, ge=1, le=100, description="Holders a task may lose (crash, freeze) before it is lost."
    )
    task_token_budget: int = Field(
        50_000, ge=1, le=10_000_000, description="Most input+output tokens one delegated sub-agent may use."
    )
    max_tasks_per_run: int = Field(
        8,
        ge=0,
        le=1000,
        description="Background tasks one run may start; a delegation past it is an error result the model reads.",
    )
    max_open_tasks_per_user: int = Field(
        32,
        ge=1,
        le=100_000,
        description=(
            "Background tasks one user may have queued or running at once; a delegation past it is an error "
            "result the model reads (enforced again, atomically, when the run's finish inserts the task)."
        ),
    )
    max_delegation_depth: int = Field(
        2, ge=0, le=10, description="How deep sub-agents may delegate: 1 lets runs delegate, 2 lets their tasks too."
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> WorkerSettings:
        if self.backoff_cap_s < self.backoff_base_s:
            raise ValueError("VIGIL_BACKOFF_CAP_S must be at least VIGIL_BACKOFF_BASE_S")
        if self.finish_concurrency >= self.db_pool_max:
            raise ValueError(
                "VIGIL_FINISH_CONCURRENCY must be below VIGIL_DB_POOL_MAX: each finish in flight holds a ledger "
                "connection, and the claim passes need one too"
            )
        if self.revoke_grace_s * 1000 * 2 > self.kafka_max_poll_interval_ms:
            # When the ledger cannot take the hand-over, the revoke waits out the grace in
            # its callback, holding the poll loop: past the poll interval the group would drop
            # that worker. (The next owner's takeover waits at most half of it too.)
            raise ValueError("VIGIL_REVOKE_GRACE_S must be at most half of VIGIL_KAFKA_MAX_POLL_INTERVAL_MS")
        if self.task_stale_s < 2 * self.task_heartbeat_s:
            # One late heartbeat (a GC pause, a slow commit) must not take a live task back.
            raise ValueError("VIGIL_TASK_STALE_S must be at least twice VIGIL_TASK_HEARTBEAT_S")
        return self

    @property
    def task_fence_s(self) -> float:
        """A holder none of whose heartbeats got through for this long stops executing: half of
        VIGIL_TASK_STALE_S, so it has stopped well before the reaper may take the task back
        (docs/tasks.md, "What is at most once")."""
        return self.task_stale_s / 2

    @property
    def lost_verdict_s(self) -> float:
        """How long a lone last attempt that a takeover handed back waits before it is its
        event's death: three session timeouts, for the worker that lost it, if alive, to see
        its loss, cancel the run and give the attempt back (a crashed one never does)."""
        return 3 * self.kafka_session_timeout_ms / 1000.0

    @property
    def batch_window_s(self) -> float:
        return self.batch_window_ms / 1000.0
