"""Typed settings, read from ``VIGIL_*`` environment variables.

Every service has one settings class: it subclasses :class:`CommonSettings` in its own
package (``vigil/worker/settings.py`` and so on) and is loaded once at start-up through
:func:`load`, which turns any validation failure into :class:`SettingsError` naming the
variable, so a bad deployment fails at once with a message an operator can act on rather
than crash-looping later.

Each field's ``description`` is its documentation: ``vigil config`` prints the table that
docs/settings.md carries, and a test keeps the two in step.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Any, Literal, TypeVar

import psycopg
from cryptography.fernet import Fernet
from psycopg.conninfo import conninfo_to_dict
from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from vigil.errors import VigilError

ENV_PREFIX = "VIGIL_"
KAFKA_OPT_PREFIX = "VIGIL_KAFKA_OPT_"
KAFKA_LOGGER = logging.getLogger("vigil.kafka")  # librdkafka's log, through Python logging

DEFAULT_KAFKA_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_DATABASE_URL = "postgresql://vigil@127.0.0.1:5432/vigil"
DEFAULT_EVENTS_TOPIC = "vigil.events"
DEFAULT_DLQ_TOPIC = "vigil.events.dlq"
DEFAULT_DELIVERIES_TOPIC = "vigil.deliveries"
DEFAULT_PARTITIONS = 12
DEFAULT_INGEST_PORT = 8080
DEFAULT_WORKER_METRICS_PORT = 9102
DEFAULT_SCHEDULER_METRICS_PORT = 9103
DEFAULT_DISPATCHER_METRICS_PORT = 9104
# Long enough for a broker leader election on a small cluster, short enough that an HTTP
# client waiting on ingest gets a 503 before its own timeout fires.
DEFAULT_PRODUCE_TIMEOUT_S = 10.0
# Three copies survive one broker lost while a second is being restarted; min.insync.replicas
# of 2 makes an acks=all write wait for two of them, so an acknowledged event survives the
# loss of any one broker. A single-broker dev stack sets VIGIL_TOPIC_REPLICATION=1.
DEFAULT_TOPIC_REPLICATION = 3
DEFAULT_MIN_INSYNC_REPLICAS = 2
# Seven days: the ledger's default dedup window (VIGIL_DEDUP_WINDOW_DAYS). Any copy Kafka can
# still redeliver is then one the ledger still recognises as a duplicate (docs/deploy.md).
DEFAULT_EVENTS_RETENTION_HOURS = 168.0


class SettingsError(VigilError):
    """A setting is missing or invalid; the message names the variable."""


def fernet_keys(value: str) -> list[Fernet]:
    """The Fernet keys of a comma-separated list (VIGIL_SECRET_KEY holds one)."""
    keys = []
    for key in (k.strip() for k in value.split(",")):
        try:
            keys.append(Fernet(key.encode()))
        except ValueError:
            raise ValueError("expected Fernet keys (url-safe base64 of 32 bytes; `vigil secrets new-key`)") from None
    return keys


class CommonSettings(BaseSettings):
    """Settings every vigil process reads."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    env: Literal["development", "production"] = Field(
        "development",
        description="The deployment's profile. production: what development only warns about is refused "
        "(no VIGIL_SECRET_KEY: services do not start, commands store no secret in clear). The Kubernetes base sets it.",
    )
    kafka_bootstrap: str = Field(
        DEFAULT_KAFKA_BOOTSTRAP,
        description="Kafka bootstrap servers, comma separated host:port.",
    )
    database_url: SecretStr = Field(
        SecretStr(DEFAULT_DATABASE_URL),
        description="PostgreSQL connection URL of the ledger (libpq form). Never logged.",
    )
    ledger_shards: SecretStr | None = Field(
        None,
        description="The ledger's shards: their PostgreSQL URLs, comma separated, shard 0 first. Shard 0 is the "
        "catalog and must be VIGIL_DATABASE_URL's database; each Kafka partition of the events topic belongs to one "
        'shard (docs/architecture.md, "Shards and the catalog"). Unset: one shard, VIGIL_DATABASE_URL. Never logged.',
    )
    events_topic: str = Field(DEFAULT_EVENTS_TOPIC, description="Topic every event goes through.")
    dlq_topic: str = Field(
        DEFAULT_DLQ_TOPIC,
        description="Dead-letter topic: undecodable messages and dead events, reason in headers.",
    )
    deliveries_topic: str = Field(
        DEFAULT_DELIVERIES_TOPIC, description="Topic of the dispatcher's kafka delivery channel."
    )
    partitions: int = Field(
        DEFAULT_PARTITIONS,
        ge=1,
        le=10_000,
        description="Partitions of the events topic when vigil creates it (`vigil topics`).",
    )
    topic_replication: int = Field(
        DEFAULT_TOPIC_REPLICATION,
        ge=1,
        le=32,
        description="Replication factor of the topics `vigil topics` creates (at most the broker count).",
    )
    topic_min_insync_replicas: int | None = Field(
        None,
        ge=1,
        le=32,
        description="`min.insync.replicas` of the topics `vigil topics` creates. Unset: 2 when "
        "replicated, 1 with VIGIL_TOPIC_REPLICATION=1.",
    )
    run_journal_days: int = Field(
        0,
        ge=0,
        le=3650,
        description="Days a finished run's journal is kept for operators (`vigil runs show`, the console): the "
        "worker's finish keeps it, the scheduler's pruner drops it after; 0 deletes it in the run's finish.",
    )
    events_retention_hours: float = Field(
        DEFAULT_EVENTS_RETENTION_HOURS,
        gt=0,
        le=24 * 365 * 10,
        description="`retention.ms` of the events topic `vigil topics` creates, in hours; at most the "
        "ledger's dedup window (VIGIL_DEDUP_WINDOW_DAYS), see docs/deploy.md.",
    )
    schema_registry_url: str | None = Field(
        None,
        description="Confluent Schema Registry URL. Set: Confluent wire format. Unset: Avro "
        "single-object encoding (no server needed).",
    )
    produce_timeout_s: float = Field(
        DEFAULT_PRODUCE_TIMEOUT_S,
        gt=0,
        le=300,
        description="How long a producer waits for the broker's acknowledgement before the "
        "caller sees a failure (ingest answers 503).",
    )
    approval_secret: SecretStr | None = Field(
        None,
        description="Key that signs approval answer tokens (ingest verifies, worker signs). "
        "Required by ingest and worker; `make up` generates one. Never logged.",
    )
    secret_key: SecretStr | None = Field(
        None,
        description="Fernet key (AES-256-GCM is derived from it) that seals hook and channel secrets in the "
        "ledger, each bound to its row (`vigil secrets new-key` makes one; `make up` generates one per stack). "
        "Unset: secrets are stored in clear with a warning (a start-up error with VIGIL_ENV=production), and a "
        "service refuses to start once a sealed one exists. Never logged.",
    )
    secret_old_keys: SecretStr | None = Field(
        None,
        description="Older Fernet keys, comma separated, that still open sealed secrets while `vigil secrets "
        "rotate` seals them again with VIGIL_SECRET_KEY (docs/operations.md). Never logged.",
    )
    instance_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Name of this process in the ledger (partition holder, run worker). Default: hostname-pid.",
    )
    log_level: str = Field("INFO", description="Python log level: DEBUG, INFO, WARNING, ERROR.")
    log_format: Literal["json", "text"] = Field(
        "json",
        description="Log lines on stderr: json (one object per line: ts, level, service, logger, msg, and "
        "user_id, event_id, run_id, partition, epoch, trace_id where known) or text (for a terminal).",
    )
    outbound_allowed_nets: str = Field(
        "",
        description="Comma-separated IP networks outbound HTTP (webhook channels, the agent's http_request) may "
        "reach although they are not public, e.g. `127.0.0.0/8,::1/128` for a local receiver. Default: none; "
        "loopback, private, link-local (cloud metadata) and other non-global addresses are refused, also in "
        "IPv6 forms that carry them (`::ffff:`, NAT64 `64:ff9b::`, 6to4 `2002::`, Teredo).",
    )

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_has_port(cls, value: str) -> str:
        for server in value.split(","):
            host, sep, port = server.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"expected host:port[,host:port...], got {value!r}")
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url_scheme(cls, value: SecretStr) -> SecretStr:
        raw = value.get_secret_value()
        if not raw.startswith(("postgresql://", "postgres://")) and "=" not in raw:
            raise ValueError("expected a postgresql:// URL or a libpq key=value string")
        return value

    @field_validator("ledger_shards")
    @classmethod
    def _shard_urls(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value().strip():  # empty: unset
            parse_shards(value.get_secret_value())
        return value

    @field_validator("secret_key", "secret_old_keys")
    @classmethod
    def _fernet_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value().strip():  # empty: unset
            fernet_keys(value.get_secret_value())
        return value

    @field_validator("outbound_allowed_nets")
    @classmethod
    def _networks(cls, value: str) -> str:
        parse_networks(value)
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("expected DEBUG, INFO, WARNING or ERROR")
        return value.upper()

    @model_validator(mode="after")
    def _insync_within_replication(self) -> CommonSettings:
        if self.topic_min_insync_replicas is not None and self.topic_min_insync_replicas > self.topic_replication:
            raise ValueError(
                f"VIGIL_TOPIC_MIN_INSYNC_REPLICAS={self.topic_min_insync_replicas} is more than "
                f"VIGIL_TOPIC_REPLICATION={self.topic_replication}: no write could ever be acknowledged"
            )
        return self

    @model_validator(mode="after")
    def _shards_fit(self) -> CommonSettings:
        dsns = self.shard_dsns
        if len(dsns) > 1 and not same_database(dsns[0], self.dsn):
            raise ValueError(
                "VIGIL_LEDGER_SHARDS: its first entry is shard 0, the catalog, and must name VIGIL_DATABASE_URL's "
                "database (its host, port and database name)"
            )
        if len(dsns) > self.partitions:
            raise ValueError(
                f"VIGIL_LEDGER_SHARDS names {len(dsns)} shards, more than VIGIL_PARTITIONS={self.partitions}: "
                "a shard would hold no partition"
            )
        return self

    @property
    def shard_dsns(self) -> tuple[str, ...]:
        """The ledger's shards, shard 0 (the catalog) first: VIGIL_DATABASE_URL alone when
        VIGIL_LEDGER_SHARDS is unset."""
        if self.ledger_shards is None or not self.ledger_shards.get_secret_value().strip():
            return (self.dsn,)
        return parse_shards(self.ledger_shards.get_secret_value())

    @property
    def min_insync_replicas(self) -> int:
        if self.topic_min_insync_replicas is not None:
            return self.topic_min_insync_replicas
        return min(DEFAULT_MIN_INSYNC_REPLICAS, self.topic_replication)

    @property
    def dsn(self) -> str:
        return self.database_url.get_secret_value()

    def kafka_client_options(self) -> dict[str, Any]:
        """Pass-through librdkafka settings for SASL/TLS clusters.

        ``VIGIL_KAFKA_OPT_SECURITY_PROTOCOL=SASL_SSL`` becomes ``security.protocol``: librdkafka
        names use dots and never underscores, so the mapping is unambiguous. librdkafka's own
        log lines go to the ``vigil.kafka`` logger (JSON like every other line), not raw to stderr.
        """
        options: dict[str, Any] = {"bootstrap.servers": self.kafka_bootstrap, "logger": KAFKA_LOGGER}
        for name, value in os.environ.items():
            if name.startswith(KAFKA_OPT_PREFIX) and len(name) > len(KAFKA_OPT_PREFIX):
                options[name[len(KAFKA_OPT_PREFIX) :].lower().replace("_", ".")] = value
        return options


S = TypeVar("S", bound=CommonSettings)


def parse_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``"127.0.0.0/8, ::1/128"`` -> networks; ValueError naming the bad entry."""
    nets = []
    for entry in text.split(","):
        entry = entry.strip()
        if entry:
            try:
                nets.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP network such as 10.0.0.0/8 or ::1/128") from None
    return tuple(nets)


def same_database(first: str, second: str) -> bool:
    """Whether two libpq DSNs name one database of one server (whoever connects, with any password)."""
    a, b = conninfo_to_dict(first), conninfo_to_dict(second)
    return all(a.get(part) == b.get(part) for part in ("host", "port", "dbname"))


def parse_shards(text: str) -> tuple[str, ...]:
    """``"postgresql://...,postgresql://..."`` -> the shards' DSNs, shard 0 first; ValueError
    naming the entry by its index, never showing one (they carry passwords). URLs only: a libpq
    ``key=value`` string may hold a comma."""
    entries = [entry.strip() for entry in text.split(",")]
    for index, entry in enumerate(entries):
        if not entry:
            raise ValueError(f"entry {index} is empty (a stray comma?)")
        if not entry.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"entry {index} is not a postgresql:// URL")
        try:
            conninfo_to_dict(entry)
        except psycopg.ProgrammingError:
            raise ValueError(f"entry {index} is not a valid PostgreSQL URL") from None
    for later, entry in enumerate(entries):
        for earlier in range(later):
            if same_database(entries[earlier], entry):
                raise ValueError(f"entries {earlier} and {later} name the same database: a shard is listed once")
    return tuple(entries)


def load(cls: type[S], **overrides: Any) -> S:
    """Read ``cls`` from the environment; raise :class:`SettingsError` naming the variable."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            if not error["loc"]:  # a rule across fields: its message names them
                problems.append(str(error["msg"]).removeprefix("Value error, "))
                continue
            field = str(error["loc"][0])
            variable = ENV_PREFIX + field.upper()
            shown = os.environ.get(variable)
            secret = "url" in field or "secret" in field or "key" in field or "shards" in field
            value = "" if shown is None or secret else f"={shown!r}"
            problems.append(f"{variable}{value}: {error['msg']}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None


def settings_rows(classes: list[type[CommonSettings]]) -> list[dict[str, str]]:
    """Every variable with its services, default and meaning (``vigil config --json``)."""
    rows: dict[str, tuple[str, str, list[str]]] = {}
    for cls in classes:
        for name, info in cls.model_fields.items():
            common = name in CommonSettings.model_fields
            service = "all" if common else getattr(cls, "service_name", cls.__name__)
            variable = ENV_PREFIX + name.upper()
            if info.default_factory is not None:
                default = "(computed)"
            elif isinstance(info.default, SecretStr):
                default = f"`{info.default.get_secret_value()}`"
            elif info.default is None:
                default = "(unset)"
            else:
                default = f"`{info.default}`"
            entry = rows.setdefault(variable, (default, info.description or "", []))
            if service not in entry[2]:
                entry[2].append(service)
    out = []
    for variable in sorted(rows):
        default, description, services = rows[variable]
        who = "all" if "all" in services else ", ".join(sorted(services))
        out.append({"variable": variable, "services": who, "default": default, "meaning": description})
    out.append(
        {
            "variable": f"{KAFKA_OPT_PREFIX}<NAME>",
            "services": "all",
            "default": "(unset)",
            "meaning": "Any librdkafka setting, e.g. `VIGIL_KAFKA_OPT_SASL_MECHANISMS=PLAIN` sets `sasl.mechanisms`.",
        }
    )
    return out


def settings_table(classes: list[type[CommonSettings]]) -> str:
    """The configuration table of docs/settings.md: every variable, its default and its meaning."""
    lines = ["| variable | services | default | meaning |", "| --- | --- | --- | --- |"]
    for row in settings_rows(classes):
        lines.append(f"| `{row['variable']}` | {row['services']} | {row['default']} | {row['meaning']} |")
    return "\n".join(lines)
