"""What every vigil process does the same way: logging, settings, signals, health."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import TypeVar

import click

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


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # Connection-level chatter would drown the service's own lines.
    for noisy in ("httpx", "uvicorn.access", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_or_exit(cls: type[S]) -> S:
    """Settings for a service; a bad setting exits 2 with the variable named, never a traceback."""
    try:
        settings = load(cls)
    except SettingsError as exc:
        click.echo(f"vigil: {exc}", err=True)
        sys.exit(2)
    setup_logging(settings.log_level)
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
