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
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

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
