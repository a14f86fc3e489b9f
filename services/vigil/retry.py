"""One retry policy: one backoff function, and what each service loop retries and how long it waits.

* :func:`backoff`: exponential from ``base_s``, never past ``cap_s``, times a random factor
  drawn from ``jitter``, never shorter than a server's Retry-After. Every backoff in vigil is
  this function: a run's retry (``worker/runs.py``, ``worker/finish.py``), a model call's
  (``agent/model.py``), a delivery's (``dispatcher/pacing.py``). Two SQL statements compute
  it per row and say so (``ledger/queries/partitions.sql``, ``recovery.sql``).
* :class:`RetryPolicy`: a loop's ``retry_policy(exc) -> (label, pause)``: which exceptions
  the loop survives (:attr:`RetryPolicy.retried`, the ``except`` clause), the label it
  counts and logs them under (:func:`failure_label`), and the pause, :func:`backoff` over
  the consecutive failures. The scheduler, dispatcher and worker claim loops each hold one
  (:func:`scheduler_pass`, :func:`dispatcher_pass`, :func:`worker_claim_pass` below say with what).
* :func:`retry_after_seconds`: a server's ``Retry-After`` (or ``retry-after-ms``) as seconds, the
  one parser of it: a delivery receiver's answer (``dispatcher/channels.py``) and the model
  API's (``agent/model.py``) feed :func:`backoff`'s ``retry_after_s`` through it.
"""

from __future__ import annotations

import email.utils
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC

import psycopg

from vigil.bus.kafka import ProduceError


def backoff(
    attempt: int,
    base_s: float,
    cap_s: float,
    *,
    jitter: tuple[float, float] = (0.5, 1.0),
    retry_after_s: float | None = None,
    retry_after_max_s: float = math.inf,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1-based).

    ``base_s * 2 ** (attempt - 1)``, at most ``cap_s``, times a factor drawn uniformly from
    ``jitter`` and again at most ``cap_s`` (a factor above 1 stretches but never past the
    cap). A server's Retry-After is honoured even past the cap, up to ``retry_after_max_s``.
    ``jitter=(1.0, 1.0)`` is no jitter.
    """
    factor = (rng or random).uniform(*jitter) if jitter != (1.0, 1.0) else 1.0
    delay = min(cap_s, min(cap_s, base_s * 2 ** min(max(0, attempt - 1), 60)) * factor)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, retry_after_max_s))
    return delay


def retry_after_seconds(headers: Mapping[str, str], now: float) -> float | None:
    """Seconds a server asked to wait, from its answer's headers; ``None`` when it did not say.

    ``headers`` is a case-insensitive mapping (``httpx.Headers``; a plain dict needs lower-case
    names). ``retry-after-ms`` (milliseconds, sent by the Anthropic API among others) wins over
    ``Retry-After``, which is delta-seconds or an HTTP date, measured from ``now`` (epoch
    seconds: the caller's clock). A date in the past is 0; anything unreadable is ``None``, so
    a malformed header falls back to the plain backoff instead of failing the retry.
    """
    milliseconds = headers.get("retry-after-ms")
    if milliseconds is not None:
        seconds = _seconds(milliseconds)
        if seconds is not None:
            return seconds / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _seconds(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": UTC by RFC 5322
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)


def _seconds(value: str) -> float | None:
    """A non-negative finite number of seconds (or milliseconds), else ``None``."""
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return max(0.0, number) if math.isfinite(number) else None


def failure_label(exc: BaseException) -> str:
    """What failed, as loops count and log it: ``broker``, ``ledger`` or ``error`` (anything else)."""
    if isinstance(exc, ProduceError):
        return "broker"
    if isinstance(exc, psycopg.Error):
        return "ledger"
    return "error"


@dataclass
class RetryPolicy:
    """A service loop's retry policy; one instance per loop (it counts consecutive failures).

    In the loop: ``except policy.retried as exc: label, pause = policy(exc)`` and, after a
    pass that succeeded, ``policy.succeeded()``. An exception not in ``retried`` is not
    caught: it ends the loop, and the process exits 1 (``service.EXIT_LOOP_DIED``).
    """

    base_s: float
    cap_s: float
    retried: tuple[type[BaseException], ...] = (Exception,)
    jitter: tuple[float, float] = (1.0, 1.0)
    failures: int = field(default=0, init=False)

    def __call__(self, exc: BaseException) -> tuple[str, float]:
        self.failures += 1
        return failure_label(exc), backoff(self.failures, self.base_s, self.cap_s, jitter=self.jitter)

    def succeeded(self) -> None:
        self.failures = 0


# The loops' policies, their pauses as they were before there was one policy. No jitter: each
# is one process's pause before its next pass, not many clients returning at once.
# The scheduler's ceiling while the broker or the database is down.
SCHEDULER_MAX_BACKOFF_S = 30.0
# The dispatcher's pause after a database error: long enough not to spin on a restarting server.
DISPATCHER_RECONNECT_PAUSE_S = 2.0
# The worker's claim pass again after a ledger or network error.
WORKER_CLAIM_RETRY_S = 1.0


def scheduler_pass(tick_s: float) -> RetryPolicy:
    """The scheduler survives any failure of a pass (it rolled back): one tick, doubling, to 30 s."""
    return RetryPolicy(base_s=tick_s, cap_s=SCHEDULER_MAX_BACKOFF_S, retried=(Exception,))


def dispatcher_pass() -> RetryPolicy:
    """The dispatcher survives ledger errors (it reconnects): 2 s each time."""
    return RetryPolicy(
        base_s=DISPATCHER_RECONNECT_PAUSE_S, cap_s=DISPATCHER_RECONNECT_PAUSE_S, retried=(psycopg.Error,)
    )


def worker_claim_pass() -> RetryPolicy:
    """The worker's claim loop survives ledger and network errors: the pass again in 1 s."""
    return RetryPolicy(base_s=WORKER_CLAIM_RETRY_S, cap_s=WORKER_CLAIM_RETRY_S, retried=(psycopg.Error, OSError))
