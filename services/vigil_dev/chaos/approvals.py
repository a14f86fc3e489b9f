"""The chaos run's approvers: the people who answer the approval questions of the approval
users (:class:`vigil_dev.chaos.load.Cast`), whose profile asks before every ``http_request``.

Each question the dispatcher delivered (an outbox message holding ``request_id`` and
``token``, as the person reads it) is answered through ingest's API, ``POST
/v1/approvals/{id}``, retried through faults until ingest answers: ``yes``, ``no``, or
``yes`` on purpose after the deadline (seeded per request). What the checker then holds the
stack to (:func:`vigil_dev.chaos.checks.approvals_verdict`): every request ends answered or
expired; an approved call runs, under the request id as its key, and no call runs for a
request denied or expired; an answer sent after the deadline is refused (409), one in time is
stored as sent, or refused only as ``expired`` or ``already_answered`` with the same answer
standing (a retry whose first try was stored).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import psycopg

from vigil.ledger.db import connect
from vigil_dev.queries import Q

# The question's machine-readable lines (docs/agent.md, "Approvals").
QUESTION = re.compile(r"^request_id: (?P<rid>\S+)$.*?^token: (?P<token>\S+)$", re.S | re.M)
POLL_S = 0.5
RETRY_S = 0.5
# Answers in time go out within this many seconds of the question's delivery; late ones this
# long after the deadline.
THINK_S = (0.2, 3.0)
LATE_S = 1.0
# The share of questions answered no, and answered late (the rest: yes in time).
NO_SHARE = 0.25
LATE_SHARE = 0.2


@dataclass
class Answer:
    request_id: str
    user_id: str
    sent: str  # yes | no
    late: bool  # sent after the deadline on purpose
    due: datetime
    status: int = 0  # ingest's final status (0: never answered)
    error: str = ""  # the 409's error code
    standing: str = ""  # the answer that stands, as the 409 says
    last_sent_at: datetime | None = None


class Approver:
    """Answers the approval questions delivered to ``users`` until :meth:`stop`."""

    def __init__(self, dsns: list[str], url: str, prefix: str, users: frozenset[str], seed: int) -> None:
        self.dsns = dsns
        self.url = url
        self.prefix = prefix
        self.users = users
        self.seed = seed
        self.answers: dict[str, Answer] = {}
        self._stopping = False

    def stop(self) -> None:
        self._stopping = True

    async def run(self) -> None:
        if not self.users:
            return
        async with httpx.AsyncClient(timeout=5.0) as client, asyncio.TaskGroup() as group:
            while not self._stopping:
                try:
                    questions = await asyncio.to_thread(self._questions)
                except psycopg.Error:
                    questions = []  # a ledger server down (a fault): asked again at the next poll
                for row in questions:
                    if row["request_id"] in self.answers or row["user_id"] not in self.users:
                        continue
                    rng = random.Random(f"{self.seed}-{row['request_id']}")
                    roll = rng.random()
                    answer = Answer(
                        row["request_id"],
                        row["user_id"],
                        "no" if roll < NO_SHARE else "yes",
                        late=roll >= 1 - LATE_SHARE,
                        due=row["due"],
                    )
                    self.answers[answer.request_id] = answer
                    wait = (
                        (answer.due - datetime.now(UTC)).total_seconds() + LATE_S
                        if answer.late
                        else rng.uniform(*THINK_S)
                    )
                    group.create_task(self._answer(client, answer, row["token"], max(wait, 0.0)))
                await asyncio.sleep(POLL_S)

    def _questions(self) -> list[dict]:
        found = []
        for dsn in self.dsns:
            with connect(dsn, autocommit=True) as conn:
                for row in conn.execute(Q.chaos_approval_questions, {"prefix": self.prefix + "%"}).fetchall():
                    m = QUESTION.search(row["body"])
                    if m and m["rid"] == row["request_id"]:
                        found.append({**row, "token": m["token"]})
        return found

    async def _answer(self, client: httpx.AsyncClient, answer: Answer, token: str, wait: float) -> None:
        await asyncio.sleep(wait)
        body = {"answer": answer.sent, "token": token}
        give_up = time.monotonic() + 120.0
        while time.monotonic() < give_up:
            answer.last_sent_at = datetime.now(UTC)
            try:
                response = await client.post(f"{self.url}/v1/approvals/{answer.request_id}", json=body)
            except httpx.HTTPError:
                await asyncio.sleep(RETRY_S)
                continue
            if response.status_code >= 500 or response.status_code == 429:
                await asyncio.sleep(RETRY_S)
                continue
            answer.status = response.status_code
            try:
                doc = response.json()
            except ValueError:
                doc = {}
            answer.error = str(doc.get("error", ""))
            answer.standing = str(doc.get("answer", ""))
            return
