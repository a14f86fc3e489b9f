"""`vigil worker`: one process, three activities.

- the consumer thread (:mod:`vigil.worker.consumer`): poll, record, store offsets;
- the run loop (:mod:`vigil.worker.runner`) on an asyncio event loop in the main thread:
  claim, run the agent, group-commit finishes; beside it, on the same loop, background
  tasks: claim and execute under a heartbeat (:mod:`vigil.worker.tasks`), reap and report
  (:mod:`vigil.worker.task_upkeep`);
- the health server thread: /healthz, /readyz, /metrics.

SIGTERM: stop claiming, give runs a grace period to finish and commit, release the rest,
close the consumer (its revoke commits the stored offsets), exit 0; all of it within
VIGIL_SHUTDOWN_GRACE_S, so the pod's termination grace never cuts it short.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

from psycopg import OperationalError

from vigil import tracing
from vigil.agent import make_agent
from vigil.bus.kafka import EventProducer
from vigil.health import HealthServer, Readiness, dependency_checks
from vigil.ledger import db
from vigil.ledger.shardmap import ShardMapError
from vigil.ledger.shards import load_map
from vigil.service import EXIT_LOOP_DIED, StartupError, stop_event
from vigil.settings import SettingsError
from vigil.worker import loop_lag, metrics
from vigil.worker.consumer import ConsumerLoop
from vigil.worker.deadletters import DeadLetters
from vigil.worker.journal import refuse_unjournaled_actions
from vigil.worker.runner import Runner
from vigil.worker.settings import WorkerSettings
from vigil.worker.shards import Shards
from vigil.worker.task_upkeep import TaskUpkeep
from vigil.worker.tasks import TaskExecutor

log = logging.getLogger("vigil.worker")

# Of VIGIL_SHUTDOWN_GRACE_S, what is kept after the runs' drain for committing their finishes
# and closing the consumer (its revoke commits offsets and leaves the group): a close rarely
# takes a second, but a broker that is failing over can hold it for several.
CLOSE_RESERVE_S = 10.0


def shutdown_budget(grace_s: float) -> tuple[float, float]:
    """Split the shutdown grace into (seconds for runs, seconds for finishes and close)."""
    reserve = min(CLOSE_RESERVE_S, grace_s / 2)
    return grace_s - reserve, reserve


GC_YOUNG_THRESHOLD = 10_000  # allocations between young collections (Python's default: 700)
GC_MIDDLE_THRESHOLD = 100  # young collections between middle ones (Python's default: 10)
GC_OLD_THRESHOLD = 100  # middle collections between full ones (Python's default: 10)


async def run(settings: WorkerSettings, stopping: threading.Event) -> int:
    """The worker until ``stopping`` is set; its exit status (``EXIT_LOOP_DIED`` if the
    consumer or one of the loops died)."""
    loop = asyncio.get_running_loop()
    try:
        agent = make_agent(settings)
        refuse_unjournaled_actions(settings, agent)
    except SettingsError as exc:  # e.g. VIGIL_AGENT=claude without ANTHROPIC_API_KEY
        raise StartupError(str(exc)) from None
    producer = EventProducer(settings)
    dead_letters = DeadLetters(settings, producer)
    pool = db.async_pool(
        settings.dsn, name="worker", min_size=2, max_size=settings.db_pool_max, autocommit=True, check=False
    )
    await pool.open(wait=True, timeout=30)
    try:
        shard_map = load_map(settings.shard_dsns, connect_timeout=30)
    except (OperationalError, ShardMapError) as exc:
        raise StartupError(f"the ledger's shard map: {exc}") from None

    def shard_pool(dsn: str, shard: int) -> db.AsyncPool:
        return db.async_pool(
            dsn, name=f"worker-shard-{shard}", min_size=2, max_size=settings.db_pool_max, autocommit=True, check=False
        )

    shards = Shards(pool, shard_map, make_pool=shard_pool, partitions=settings.partitions)
    # The catalog's pool for profiles, policies and the model fleet; the users' shards for their spending.
    await agent.join_fleet(pool, settings.instance_id, None if shards.single else shards.pool_of_user)
    runner = Runner(settings, agent, shards, dead_letters)
    readiness = Readiness(dependency_checks(settings))
    readiness.notes["down"] = agent.down  # MCP servers not listed: the runs go on without their tools
    health = HealthServer(settings.worker_port, readiness).start()
    # The consumer has its own stop: it stays in the group while runs drain (closing it
    # revokes the partitions, which would cancel every run at once) and closes after them.
    closing = threading.Event()
    consumer = ConsumerLoop(settings, runner, loop, dead_letters, closing, runner.clock, shards)
    # The reaper and the reporter are fleet-wide, whatever this process holds; the executor
    # only wakes the reporter when an outcome of its own stands.
    upkeep = TaskUpkeep(settings, shards, producer, runner.clock)
    executor = TaskExecutor(settings, agent, shards, runner.clock, wake_report=upkeep.wake_report)
    # A lone last attempt runs with nothing else in flight here, background tasks included.
    executor.hold_off = runner.lone.tasks_hold_off
    runner.lone.drain_beside(executor)
    tasks = [
        asyncio.create_task(runner.claimer.claim_loop(), name="claim-loop"),
        *(
            asyncio.create_task(runner.finisher.finish_loop(), name=f"finish-loop-{i}")
            for i in range(settings.finish_concurrency)
        ),
        asyncio.create_task(runner.finisher.gauge_loop(), name="gauges"),
        asyncio.create_task(loop_lag.watch(metrics.EVENT_LOOP_LAG.observe), name="loop-lag"),
        *(
            asyncio.create_task(loop_, name=f"tasks-{i}")
            for i, loop_ in enumerate([*upkeep.loops(), *executor.loops()])
        ),
        *(asyncio.create_task(loop_, name=f"agent-{i}") for i, loop_ in enumerate(agent.loops())),
    ]
    # Everything allocated so far (modules, the SDK's ~180,000 type objects, pools) lives as
    # long as the process: keep it out of the collector's full passes. Unfrozen, each full
    # pass walked all of it (about 2 s of CPU on a busy machine), and with thousands of runs
    # in flight allocating, full passes came often: CPU per run grew with the runs in flight.
    gc.freeze()
    # A young-generation collection every 10,000 allocations instead of every 700: a model
    # call allocates thousands of short-lived objects, and each collection also promoted the
    # runs in flight toward the full passes. At 1,500 runs in flight: the collector's CPU
    # 1.0 -> 0.4 s per 1,500 runs, no change in resident memory.
    # A middle-generation collection every 100 young ones instead of every 10: a run in flight
    # lives seconds, so its objects survived every young and middle pass and were walked by
    # both; with the longer middle window most of them are freed before it comes. Model-bound,
    # 2,500 runs in flight: the collector 2.0 -> 1.3 s per 10,000 runs, worker CPU per run
    # 2.10 -> 2.01 ms, resident memory unchanged (docs/performance.md, "Model-bound runs").
    # A full collection every 100 middle ones instead of every 10 (Python still skips one
    # until the objects promoted since the last make a quarter of the old generation): each
    # walks every run in flight. Model-bound, 2,500 in flight: worker CPU per run 2.09-2.10 ->
    # 2.05-2.07 ms, resident memory 280 -> 278-281 MB (docs/performance.md, "Model-bound
    # runs", change 12).
    gc.set_threshold(GC_YOUNG_THRESHOLD, GC_MIDDLE_THRESHOLD, GC_OLD_THRESHOLD)
    consumer.start()
    log.info(
        "worker %s up: group %s, topic %s, agent %s, %d concurrent runs",
        settings.instance_id,
        settings.worker_group,
        settings.events_topic,
        settings.agent,
        settings.run_concurrency,
    )
    while not stopping.is_set():
        await asyncio.sleep(0.2)
        if closing.is_set():  # the consumer died (it sets its stop): the worker stops too
            stopping.set()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception():
                log.error("%s died: %r", task.get_name(), task.exception(), extra={"event": "loop_died"})
                stopping.set()
    # Bounded end to end by VIGIL_SHUTDOWN_GRACE_S, so the pod's grace never SIGKILLs a
    # shutdown half way: runs (and background tasks) that outlive their share are cancelled
    # and released (tasks handed back to the queue).
    runs_s, _close_s = shutdown_budget(settings.shutdown_grace_s)
    deadline = time.monotonic() + settings.shutdown_grace_s
    upkeep.stop()
    await asyncio.gather(runner.drain(runs_s), executor.stop(runs_s))
    # Let the finisher commit what drained before the consumer's revoke runs.
    while not runner.finisher.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    closing.set()
    await asyncio.to_thread(consumer.join, max(0.5, deadline - time.monotonic()))
    if consumer.is_alive():
        # The ledger holds each partition's position, so the next owner resumes correctly;
        # only the group's rebalance waits for the session timeout.
        log.warning("consumer did not close within VIGIL_SHUTDOWN_GRACE_S=%g; exiting", settings.shutdown_grace_s)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # A loop that ended with an exception, before the shutdown or during it: the exit status
    # must say so (status 0 is a completion to Kubernetes, not an error).
    died = any(not task.cancelled() and task.exception() is not None for task in tasks)
    await agent.close()
    await shards.close()
    producer.close()
    health.stop()
    log.info("worker stopped")
    return EXIT_LOOP_DIED if died or consumer.error else 0


def serve(settings: WorkerSettings) -> int:
    """Run the worker until SIGTERM or SIGINT (``vigil worker``); returns the exit status."""
    tracing.setup("worker")  # only when OTEL_EXPORTER_OTLP_ENDPOINT is set
    stopping = stop_event()
    return asyncio.run(run(settings, stopping))
