"""What every vigil process does the same way: logging, settings, signals, health."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any, TypeVar

import click
import psycopg
from confluent_kafka import KafkaException

from vigil import logs
from vigil.bus.kafka import ProduceError
from vigil.errors import VigilError
from vigil.ledger import sealing
from vigil.ledger.db import connect
from vigil.ledger.migrate import pending
from vigil.ledger.sealing import SecretKeyError
from vigil.ledger.shardmap import ShardUnreachable
from vigil.settings import CommonSettings, SettingsError, load

S = TypeVar("S", bound=CommonSettings)


class StartupError(VigilError):
    """The service cannot start (a port taken, a dependency refusing); the message says why."""


# Exit codes an operator's script can tell apart: 2 is a bad setting or a service that cannot
# start (fix the deployment), 3 a dependency that does not answer (retry later); 4 is an
# operator command's conflict, the HTTP API's 409 (vigil.cliutil.EXIT_CONFLICT).
EXIT_STARTUP = 2
EXIT_DEPENDENCY = 3
# 1: a loop of the running service died of an error it does not retry (a bug, or a dependency
# that answered what nobody expected). Kubernetes shows a process that exits 0 as Completed:
# an orchestrator must see an error, and restart the service.
EXIT_LOOP_DIED = 1


def dependency_down(exc: BaseException) -> str | None:
    """One line naming the dependency behind ``exc``, or None if ``exc`` is not about one.

    psycopg's connection errors span several lines (one per address tried) and
    librdkafka's carry a struct dump; an operator needs which dependency, which setting
    points at it, and the first line of the reason.
    """
    if isinstance(exc, ShardUnreachable):
        return str(exc)
    if isinstance(exc, psycopg.OperationalError):  # psycopg_pool.PoolTimeout is one too
        return f"PostgreSQL is unreachable (VIGIL_DATABASE_URL): {first_line(exc)}"
    if isinstance(exc, KafkaException | ProduceError):
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else first_line(exc)
        bootstrap = os.environ.get("VIGIL_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
        return f"Kafka is unreachable at {bootstrap} (VIGIL_KAFKA_BOOTSTRAP): {reason}"
    return None


def first_line(exc: BaseException) -> str:
    """An exception's first line, its whitespace folded (psycopg's errors span lines)."""
    text = " ".join(str(exc).split("\n")[0].split())
    return text or type(exc).__name__


class LazyGroup(click.Group):
    """A command group whose commands are imported when one is used: ``lazy`` maps a command's
    name to the module whose ``commands`` list holds it. ``vigil ingest`` or ``vigil runs show``
    imports its own module, not every area's (the Anthropic SDK alone is over a second of CPU,
    which every command and every service start paid when the group imported them all). A
    name its module does not hold is an error when used; tests/test_cli_lazy.py checks the
    tables against the modules."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module_name = self.lazy.get(cmd_name)
        if module_name is None:
            return super().get_command(ctx, cmd_name)
        module = importlib.import_module(module_name)
        for command in getattr(module, "commands", ()):
            if command.name == cmd_name:
                return command
        raise RuntimeError(f"{module_name} holds no command {cmd_name!r}, which its group's table names there")


class VigilGroup(LazyGroup):
    """The ``vigil`` command group: start-up errors and unreachable dependencies end in one line.

    Every command, operator tool or service, gets the same rule without each catching it:
    ``StartupError`` exits 2, a database or broker that does not answer exits 3, both with
    one line on stderr and no traceback.
    """

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except StartupError as exc:
            click.echo(f"vigil: cannot start: {exc}", err=True)
            sys.exit(EXIT_STARTUP)
        except SecretKeyError as exc:
            click.echo(f"vigil: {exc}", err=True)
            sys.exit(EXIT_STARTUP)
        except Exception as exc:
            message = dependency_down(exc)
            if message is None:
                raise
            logging.getLogger("vigil").debug("dependency error", exc_info=True)
            click.echo(f"vigil: {message}", err=True)
            sys.exit(EXIT_DEPENDENCY)


def require_schema(settings: CommonSettings) -> None:
    """Refuse to start a service on a ledger whose migrations are behind this code, on any of
    its shards (VIGIL_LEDGER_SHARDS), naming the shard.

    A ledger that does not answer yet is not a reason to refuse: the service's own loops
    wait for it and report not-ready meanwhile (ingest answers 503), and on Kubernetes the
    init container has already run ``vigil migrate --check``.
    """
    shards = settings.shard_dsns
    for index, dsn in enumerate(shards):
        _require_shard_schema(dsn, f"ledger shard {index}'s" if len(shards) > 1 else "ledger's")


def _require_shard_schema(dsn: str, whose: str) -> None:
    try:
        behind = pending(dsn)
    except psycopg.OperationalError as exc:
        log = logging.getLogger("vigil")
        log.warning("schema version not checked, the ledger does not answer: %s", first_line(exc))
        return
    if behind:
        raise StartupError(
            f"the {whose} schema is behind this version ({len(behind)} migration(s) not applied, "
            f"first {behind[0]}): run `vigil migrate`"
        )


def require_secret_keys(settings: CommonSettings) -> None:
    """Refuse to start a service that reads hook or channel secrets when the ledger holds one
    sealed with a key this process lacks (VIGIL_SECRET_KEY unset, or rotated away without
    VIGIL_SECRET_OLD_KEYS): every delivery would fail later, one by one. Secrets still in
    clear are allowed, with a warning that names the way out; with ``VIGIL_ENV=production``
    no key at all is a start-up error (new secrets would be stored in clear; issue 58)."""
    log = logging.getLogger("vigil")
    try:
        sealing.keys().require_key()
        with connect(settings.dsn) as conn:
            clear = sealing.check(conn, sealing.keys())
    except psycopg.OperationalError as exc:
        log.warning("secret keys not checked, the ledger does not answer: %s", first_line(exc))
        return
    except SecretKeyError as exc:
        raise StartupError(str(exc)) from None
    if clear:
        log.warning(
            "%d secret(s) stored in clear in the ledger: set %s and run `vigil secrets rotate`",
            clear,
            sealing.KEY_SETTING,
        )


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    """JSON lines (or text) on stderr, named after the command that runs (worker, ingest, ...)."""
    ctx = click.get_current_context(silent=True)
    logs.setup(level, fmt, service=ctx.info_name if ctx is not None and ctx.info_name else "vigil")


def load_or_exit(cls: type[S]) -> S:
    """Settings for a service; a bad setting exits 2 with the variable named, never a traceback."""
    try:
        settings = load(cls)
    except SettingsError as exc:
        click.echo(f"vigil: {exc}", err=True)
        sys.exit(2)
    setup_logging(settings.log_level, settings.log_format)
    return settings


def stop_event() -> threading.Event:
    """An event set by SIGTERM or SIGINT: the service finishes what it holds and exits."""
    stopping = threading.Event()

    def handler(signum, _frame):
        logging.getLogger("vigil").info("received %s, stopping", signal.Signals(signum).name)
        stopping.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stopping
