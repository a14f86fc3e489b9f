"""`vigil scheduler`: the timer loop on the main thread; health and metrics, and the ledger
pruners (:mod:`vigil.scheduler.pruner`, one per ledger shard), each on a thread of their own.
With several shards the timer loop gives each shard its turn (:func:`vigil.scheduler.loop.run_shards`).

SIGTERM: the pass in progress finishes (what a crash mid-pass leaves behind is in
:mod:`vigil.scheduler.loop`), then the process exits 0. The pruner's thread is a daemon: a
prune cut short has committed its finished batches, and the next prune goes on from there.
The timer loop retries every error it meets; a pruner that dies (anything but a ledger error)
stops the scheduler, which then exits with ``EXIT_LOOP_DIED``.
"""

from __future__ import annotations

from vigil import tracing
from vigil.bus.kafka import EventProducer
from vigil.clock import SystemClock
from vigil.health import HealthServer, Readiness, dependency_checks
from vigil.scheduler import metrics
from vigil.scheduler.loop import Scheduler, log, run_shards
from vigil.scheduler.pruner import start_pruners
from vigil.scheduler.settings import SchedulerSettings
from vigil.service import EXIT_LOOP_DIED, stop_event


def serve(settings: SchedulerSettings) -> int:
    """Run the scheduler until SIGTERM or SIGINT (``vigil scheduler``); returns the exit status."""
    tracing.setup("scheduler")  # only when OTEL_EXPORTER_OTLP_ENDPOINT is set
    stopping = stop_event()
    readiness = Readiness(dependency_checks(settings))
    # A port taken raises StartupError: one line and exit 2 (vigil.service.VigilGroup).
    server = HealthServer(settings.scheduler_port, readiness).start()
    producer = EventProducer(settings)
    shards = len(settings.shard_dsns)
    metrics.start_shards(shards)
    clock = SystemClock()  # one clock for the timers and retention
    schedulers = [Scheduler(settings, producer, clock, shard=shard) for shard in range(shards)]
    log.info(
        "scheduler up: topic %s, %d ledger shard(s), tick %.1f s, batch %d, grace %d s, each cap %d, retention %s",
        settings.events_topic,
        shards,
        settings.scheduler_tick_s,
        settings.scheduler_batch_size,
        settings.scheduler_grace_s,
        settings.scheduler_each_cap,
        f"{settings.retention_days:g} days" if settings.retention_days else "off",
    )
    pruners = start_pruners(settings, stopping, clock)
    try:
        run_shards(schedulers, stopping, on_health=lambda ok: readiness.set("passes", ok))
    except Exception:
        log.exception("timer loop died", extra={"event": "loop_died"})
        return EXIT_LOOP_DIED
    finally:
        producer.close()
        for scheduler in schedulers:
            scheduler.close()
        server.stop()
        log.info("scheduler stopped")
    return EXIT_LOOP_DIED if any(pruner.error is not None for pruner in pruners) else 0
