"""The topics vigil needs, as the settings describe them, and how the cluster's differ.

``vigil topics`` creates the missing ones (:func:`vigil.bus.kafka.ensure_topics`) and then
compares every topic with the settings. It never changes an existing topic: raising a
replication factor is a partition reassignment, and adding partitions moves users to other
partitions; both are an operator's decision (docs/deploy.md), so the command says what
differs and leaves it there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from confluent_kafka.admin import ConfigResource, ResourceType

from vigil.bus.kafka import ensure_topics, quiet_admin
from vigil.settings import CommonSettings

HOUR_MS = 3_600_000


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication: int
    config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TopicState:
    """One topic on the cluster beside what the settings want."""

    name: str
    created: bool
    partitions: int
    replication: int
    config: dict[str, str]
    differences: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def wanted(settings: CommonSettings) -> list[TopicSpec]:
    insync = {"min.insync.replicas": str(settings.min_insync_replicas)}
    retention = {"retention.ms": str(int(settings.events_retention_hours * HOUR_MS))}
    replication = settings.topic_replication
    return [
        TopicSpec(settings.events_topic, settings.partitions, replication, {**insync, **retention}),
        TopicSpec(settings.dlq_topic, settings.partitions, replication, insync),
        TopicSpec(settings.deliveries_topic, settings.partitions, replication, insync),
    ]


def ensure(settings: CommonSettings, timeout: float = 10.0) -> list[TopicState]:
    """Create missing topics, then describe each one against the settings."""
    specs = wanted(settings)
    created = set(
        ensure_topics(
            settings,
            {spec.name: spec.partitions for spec in specs},
            timeout=timeout,
            configs={spec.name: spec.config for spec in specs},
        )
    )
    return [
        TopicState(spec.name, spec.name in created, *actual)
        for spec, actual in zip(specs, describe(settings, specs, timeout))
    ]


def describe(
    settings: CommonSettings, specs: list[TopicSpec], timeout: float
) -> list[tuple[int, int, dict[str, str], list[str]]]:
    """For each spec: partitions, replication, the compared configs, and the differences."""
    admin = quiet_admin(settings)
    topics = admin.list_topics(timeout=timeout).topics
    futures = admin.describe_configs(
        [ConfigResource(ResourceType.TOPIC, spec.name) for spec in specs], request_timeout=timeout
    )
    configs = {resource.name: future.result(timeout) for resource, future in futures.items()}
    out = []
    for spec in specs:
        partitions = topics[spec.name].partitions
        replication = min((len(p.replicas) for p in partitions.values()), default=0)
        entries = configs[spec.name]
        actual = {key: entries[key].value for key in spec.config if key in entries}
        differences = []
        if replication != spec.replication:
            differences.append(
                f"replication factor {replication}, settings want {spec.replication} (VIGIL_TOPIC_REPLICATION; "
                "change it with a partition reassignment)"
            )
        if len(partitions) != spec.partitions:
            differences.append(
                f"{len(partitions)} partitions, settings want {spec.partitions} (VIGIL_PARTITIONS; adding "
                "partitions moves users, see docs/deploy.md)"
            )
        for key, value in spec.config.items():
            if actual.get(key) != value:
                differences.append(f"{key}={actual.get(key)}, settings want {value} (kafka-configs --alter)")
        out.append((len(partitions), replication, actual, differences))
    return out
