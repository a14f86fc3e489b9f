"""Dreaming's trigger: every ``VIGIL_DREAM_CHECK_S`` the scheduler queues a memory review for
each user with ``VIGIL_DREAM_AFTER_SESSIONS`` new sessions since their last one
(:func:`vigil.ledger.dreams.schedule`; one statement, at most one open review per user
whatever the number of schedulers). Off (the default) when that setting is 0. The review
itself is a background task any worker executes (:mod:`vigil.agent.dreaming`)."""

from __future__ import annotations

import logging
import time

import psycopg
from psycopg.rows import DictRow

from vigil.clock import Clock, utc
from vigil.ledger import dreams as ledger
from vigil.scheduler import metrics
from vigil.scheduler.settings import SchedulerSettings

log = logging.getLogger("vigil.scheduler")

# A review's deadline from its creation, and the holders it may lose: those of any task.
REVIEW_TIMEOUT_S = 900.0
REVIEW_MAX_ATTEMPTS = 3


class Dreamer:
    def __init__(self, settings: SchedulerSettings, clock: Clock):
        self.settings = settings
        self.clock = clock
        self._next = 0.0  # time.monotonic() of the next look

    def maybe(self, conn: psycopg.Connection[DictRow]) -> int:
        """Queue the reviews due, if it is time to look; how many were queued."""
        s = self.settings
        if not s.dream_after_sessions or time.monotonic() < self._next:
            return 0
        made = ledger.schedule(
            conn,
            after_sessions=s.dream_after_sessions,
            token_budget=s.dream_token_budget,
            timeout_s=REVIEW_TIMEOUT_S,
            max_attempts=REVIEW_MAX_ATTEMPTS,
            now=utc(self.clock.now()),
        )
        self._next = time.monotonic() + s.dream_check_s
        for review in made:
            log.info("memory review %s queued for user %s", review.id, review.user_id)
        metrics.REVIEWS_SCHEDULED.inc(len(made))
        return len(made)
