"""`vigil dispatcher`: the loop on the main thread, health and metrics on another.

SIGTERM: no new claim; the sends in flight finish (bounded by the HTTP and produce
timeouts) and their outcomes are recorded, then the process exits 0. SIGKILL at any point is safe:
what was fixed but not recorded is sent again under the same delivery id after its lease. A
loop that dies (anything but a ledger error, which it retries) ends the process with
``EXIT_LOOP_DIED`` once its sends in flight have finished; their outcomes are not recorded,
so they go out again after their lease, under the same ids. With several ledger shards each
shard's loop runs on a thread of its own (:func:`vigil.dispatcher.loop.run_shards`).
"""

from __future__ import annotations

import logging

from vigil import tracing
from vigil.bus.kafka import EventProducer
from vigil.clock import Clock, FileClock, SystemClock
from vigil.dispatcher.channels import Channels, KafkaChannel, LogChannel, WebhookChannel
from vigil.dispatcher.loop import Dispatcher, run_shards
from vigil.dispatcher.settings import DispatcherSettings
from vigil.health import HealthServer, Readiness, dependency_checks
from vigil.outbound import address_policy
from vigil.service import EXIT_LOOP_DIED, stop_event

log = logging.getLogger("vigil.dispatcher")


def make_clock(settings: DispatcherSettings) -> Clock:
    if settings.dispatcher_clock_file is not None:
        log.warning("test hook: time is read from %s", settings.dispatcher_clock_file)
        return FileClock(settings.dispatcher_clock_file)
    return SystemClock()


def make_channels(settings: DispatcherSettings) -> Channels:
    return Channels(
        webhook=WebhookChannel(
            settings.delivery_http_timeout_s, settings.dispatcher_concurrency, address_policy(settings)
        ),
        kafka=KafkaChannel(settings.deliveries_topic, lambda: EventProducer(settings), settings.schema_registry_url),
        log_channel=LogChannel(),
    )


def serve(settings: DispatcherSettings) -> int:
    """Run the dispatcher until SIGTERM or SIGINT (``vigil dispatcher``); returns the exit status."""
    tracing.setup("dispatcher")  # only when OTEL_EXPORTER_OTLP_ENDPOINT is set
    stopping = stop_event()
    readiness = Readiness(dependency_checks(settings))
    health = HealthServer(settings.dispatcher_port, readiness).start()
    clock = make_clock(settings)
    shards = range(len(settings.shard_dsns))
    dispatchers = [Dispatcher(settings, clock, make_channels(settings), shard=shard) for shard in shards]
    log.info(
        "dispatcher %s up: %d ledger shard(s), gap %ds, %d attempts, %d concurrent sends (per shard)",
        settings.instance_id,
        len(shards),
        settings.outbox_gap,
        settings.delivery_max_attempts,
        settings.dispatcher_concurrency,
    )
    try:
        run_shards(dispatchers, stopping, on_health=lambda ok: readiness.set("ledger", ok))
    except Exception:
        # Not a ledger error (the loop retries those): a bug, or a value nobody expected.
        # One log line with the traceback, and a status the orchestrator shows as an error.
        log.exception("delivery loop died", extra={"event": "loop_died"})
        return EXIT_LOOP_DIED
    finally:
        for dispatcher in dispatchers:
            dispatcher.close()
        health.stop()
    log.info("dispatcher stopped")
    return 0
