"""Metric correctness in a real worker: a partition's lag series belongs to its holder only,
and is gone from a worker that lost the partition (a frozen value left behind would read as
lag nobody works off); the topic's partition count is exported for the unowned-partition alert;
the event loop's lag is observed all along (tests/test_worker_loop_lag.py: what it measures).
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import query, wait_for
from worker_support import FAST, chat, produce


def lag_partitions(port: int) -> dict[str, float]:
    """partition -> lag, as this worker's /metrics reports it; also the topic's partition count."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vigil_consumer_lag_messages":
                out[sample.labels["partition"]] = sample.value
            if sample.name == "vigil_events_topic_partitions":
                out["topic"] = sample.value
    return out


def loop_lag_observations(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vigil_worker_event_loop_lag_seconds_count":
                return sample.value
    return 0.0


@pytest.mark.slow
@pytest.mark.partitions(4)
def test_lag_series_follow_the_partitions_a_worker_holds(stack, topics, ledger, vigil_env, spawn):
    # librdkafka's statistics every second, not every 15 s: each wait below is for a report.
    env = {**vigil_env, **FAST, "VIGIL_AGENT": "echo", "VIGIL_KAFKA_OPT_STATISTICS_INTERVAL_MS": "1000"}
    port_a = int(env["VIGIL_WORKER_PORT"])
    spawn(["worker"], {**env, "VIGIL_INSTANCE_ID": "worker-a"}, name="a").wait_healthy(port_a)
    produce(stack.bootstrap, topics.events, [chat(f"user-{i}", "hello") for i in range(12)])

    # The first report covers all four partitions.
    wait_for(lambda: len(lag_partitions(port_a)) == 5, 40, "worker a reporting lag for 4 partitions", interval=0.2)
    assert lag_partitions(port_a)["topic"] == 4
    # The event loop's lag is observed four times a second from the start.
    seen = loop_lag_observations(port_a)
    wait_for(lambda: loop_lag_observations(port_a) >= seen + 4, 10, "the event loop's lag observed", interval=0.5)

    from vigil_dev.devstack import free_port

    port_b = free_port()
    spawn(["worker"], {**env, "VIGIL_INSTANCE_ID": "worker-b", "VIGIL_WORKER_PORT": str(port_b)}, name="b")
    wait_for(
        lambda: {r["holder"] for r in query(ledger, "SELECT holder FROM partitions")} == {"worker-a", "worker-b"},
        60,
        "both workers holding partitions",
    )
    held = {
        holder: {
            str(r["partition"])
            for r in query(ledger, "SELECT partition, holder FROM partitions")
            if r["holder"] == holder
        }
        for holder in ("worker-a", "worker-b")
    }
    # At once after the revoke: a's lag series are those of the partitions it still holds.
    wait_for(lambda: set(lag_partitions(port_a)) - {"topic"} == held["worker-a"], 10, "a's revoked lag series gone")
    # And b reports the others once its own statistics come.
    wait_for(
        lambda: set(lag_partitions(port_b)) - {"topic"} == held["worker-b"],
        40,
        "b reporting its partitions",
        interval=0.2,
    )
