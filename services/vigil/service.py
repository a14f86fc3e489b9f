"""What every vigil process does the same way: logging, settings, signals, health."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import TypeVar

import click

from vigil import logs
from vigil.settings import CommonSettings, SettingsError, load

S = TypeVar("S", bound=CommonSettings)


class StartupError(Exception):
    """The service cannot start (a port taken, a dependency refusing); the message says why."""


def exit_on_startup_error(main):
    """Run ``main()``; a StartupError becomes one line on stderr and exit code 2, no traceback."""
    try:
        return main()
    except StartupError as exc:
        click.echo(f"vigil: cannot start: {exc}", err=True)
        sys.exit(2)


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
