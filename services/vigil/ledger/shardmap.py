"""The shard map: which ledger shard holds each Kafka partition of the events topic (issue 41).

Pure: no connection, no settings. The shards are PostgreSQL databases, listed by
``VIGIL_LEDGER_SHARDS`` (``CommonSettings.shard_dsns``), shard 0 first; shard 0 is also the
catalog, the one place the global configuration lives (docs/architecture.md, "Shards").

Where a partition lives:

1. **Its row in the catalog's ``shard_map``**, when it has one. Rows are the truth: a
   partition moved to another shard (with its users) is a changed row, and a shard added
   later holds no partition until some are moved to it.
2. **Else the rule**, :func:`rule`: ``partition % shards``. It needs no partition count, so a
   partition the topic grew after the map was seeded gets a shard at once, and partitions
   spread evenly over the shards for any count. ``vigil migrate`` seeds the rows of
   ``0..VIGIL_PARTITIONS-1`` from the rule (``vigil.ledger.shards.seed``) and never rewrites
   a row, so the rule decides a partition once, when it is first seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from vigil.errors import VigilError
from vigil.partitioner import home_partition


class ShardMapError(VigilError):
    """The catalog's map names a shard that VIGIL_LEDGER_SHARDS does not list."""


class ShardUnreachable(VigilError):
    """A shard of several did not answer; the message names it (by index and password-free DSN)."""

    def __init__(self, shard: int, dsn: str, reason: str) -> None:
        super().__init__(f"ledger shard {shard} ({shown_dsn(dsn)}) is unreachable (VIGIL_LEDGER_SHARDS): {reason}")
        self.shard = shard


def rule(partition: int, *, shards: int) -> int:
    """The shard of a partition that has no row in the catalog: ``partition % shards``."""
    if partition < 0 or shards < 1:
        raise ValueError(f"no shard for partition {partition} of {shards} shard(s)")
    return partition % shards


def shown_dsn(dsn: str) -> str:
    """A DSN to print: ``postgresql://user@host:port/dbname``, its password left out (libpq's
    ``key=value`` form, still without it, when it carries other options such as sslmode)."""
    parts = {k: v for k, v in conninfo_to_dict(dsn).items() if k not in {"password", "passfile", "sslpassword"}}
    if not set(parts) <= {"user", "host", "port", "dbname"}:
        return make_conninfo("", **parts)
    who = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{who}{parts.get('host', '')}{port}/{parts.get('dbname', '')}"


@dataclass(frozen=True)
class ShardMap:
    """The shards' DSNs (shard 0, the catalog, first) and the catalog's rows (partition -> shard)."""

    dsns: tuple[str, ...]
    assigned: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.dsns:
            raise ShardMapError("no ledger shard configured")
        for partition, shard in sorted(self.assigned.items()):
            if not 0 <= shard < len(self.dsns):
                raise ShardMapError(
                    f"the catalog's shard_map puts partition {partition} on shard {shard}, but "
                    f"VIGIL_LEDGER_SHARDS lists {len(self.dsns)} shards"
                )

    @property
    def count(self) -> int:
        return len(self.dsns)

    def shard_of(self, partition: int) -> int:
        """The shard holding ``partition``'s users: its catalog row, else the rule."""
        found = self.assigned.get(partition)
        return found if found is not None else rule(partition, shards=self.count)

    def shard_of_user(self, user_id: str, *, partitions: int) -> int:
        """The shard holding ``user_id``'s state: the shard of the user's home partition among
        ``partitions`` (VIGIL_PARTITIONS, the events topic's count)."""
        return self.shard_of(home_partition(user_id, partitions))

    def dsn_of(self, partition: int) -> str:
        """The DSN of the shard holding ``partition``."""
        return self.dsns[self.shard_of(partition)]

    def partitions_of(self, shard: int, *, partitions: int) -> list[int]:
        """The partitions of ``shard`` among ``0..partitions-1`` and every partition with a row."""
        every = set(range(partitions)) | set(self.assigned)
        return sorted(p for p in every if self.shard_of(p) == shard)
