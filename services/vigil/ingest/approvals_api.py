"""``POST /v1/approvals/{request_id}``: a person's yes or no to a deferred tool call.

Steps, in order, and what a crash between them leaves behind:

1. The middleware stamps the time the request *arrived*, before the body is read.
2. One ledger transaction: read the request (none: 404 ``unknown``), check the token
   against the request's own user (bad: 403, nothing written), then
   :func:`vigil.ledger.approvals.answer` with ``received_at`` = that stamp, which stores
   the answer if it arrived before the deadline and the request was still open, stores
   ``expired`` if it arrived late, and otherwise leaves the first stored answer standing.
3. Produce :func:`vigil.ledger.approvals.wake_event` so the owning worker resumes the
   session. A crash (or a broker outage: 503) after step 2's commit leaves the answer
   stored and the wake-up unsent; the client's retry stores nothing new and produces the
   same wake-up (same key, one ledger event), and the expiry timer fires it at the deadline
   in any case.

The response says which answer stands: ``yes``, ``no`` or ``expired``; ``given`` echoes
what this request asked for, so a client can tell "your no came second" from "you said no".
The status says whether this answer counted: 200 if the answer that stands is the one given
(stored now, or a retry of it), else 409 with the same fields (``error`` ``expired``: it
arrived late; ``already_answered``: another answer came first). The wake-up is produced
either way: the session resumes with the answer that stands.

The rule lives in :mod:`vigil.ledger.approvals` and is synchronous, so step 2 runs on a
worker thread with a small synchronous pool of its own; approvals are rare next to events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Literal

import psycopg
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vigil.ingest.events_api import refuse_validation
from vigil.ingest.metrics import UNKNOWN_KEYS
from vigil.ingest.publisher import Publisher
from vigil.ingest.requests import Refusal, read_json, received_at, unavailable
from vigil.ingest.settings import IngestSettings
from vigil.ledger import approvals
from vigil.ledger.approvals import Standing
from vigil.ledger.db import Pool, PoolTimeout
from vigil.ledger.states import ApprovalAnswer
from vigil.ttl_cache import MissGuard

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
MAX_TOKEN_CHARS = 512
# Under a flood of made-up ids, requests due longer ago than this are answered 404 from the
# miss guard's set: a retry of an answer comes within minutes of it, not a day later.
ANSWERABLE_AFTER_DUE = timedelta(days=1)


class AnswerIn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    answer: Literal["yes", "no"] = Field(description="The person's decision.")
    token: str = Field(
        min_length=1, max_length=MAX_TOKEN_CHARS, description="The capability that came with the question."
    )


class AnswerOut(BaseModel):
    request_id: str
    answer: Literal["yes", "no", "expired"] = Field(description="The answer that stands (the first one stored).")
    given: Literal["yes", "no"] = Field(description="The answer this request gave.")


# A test hook: awaited after the arrival stamp and before the ledger transaction, so a
# test can make the processing delay real (an answer that arrives in time but is stored late).
BeforeAnswer = Callable[[Request], Awaitable[None]]


class ApprovalsApi:
    def __init__(
        self,
        settings: IngestSettings,
        pool: Pool,
        publisher: Publisher,
        before_answer: BeforeAnswer | None = None,
    ):
        self.secret = settings.approval_secret.get_secret_value()
        self.pool = pool
        self.publisher = publisher
        self.before_answer = before_answer
        # The route needs no API token: a made-up id was a query each (issue 46). As ingest's
        # tokens: past a budget a second, ids are checked against the set of answerable ones.
        self.misses = MissGuard(UNKNOWN_KEYS, "approval", lambda: asyncio.to_thread(self._answerable))

    def _answerable(self) -> frozenset[str]:
        with self.pool.connection() as conn:
            return approvals.answerable_ids(conn, datetime.now(UTC) - ANSWERABLE_AFTER_DUE)

    def _answer(self, request_id: str, given: ApprovalAnswer, token: str, arrived: datetime) -> Standing | None:
        """Step 2, one transaction. None: no such request. Raises a 403 Refusal on a bad token."""
        with self.pool.connection() as conn:
            with conn.transaction():
                asked = approvals.standing(conn, request_id)
                if asked.answer == approvals.UNKNOWN:
                    return None
                if not approvals.verify_token(
                    secret=self.secret, request_id=request_id, user_id=asked.user_id or "", token=token
                ):
                    raise Refusal(403, "invalid_token", "the token does not grant an answer to this request")
                return approvals.answer(conn, request_id, given, arrived)

    async def post(self, request: Request) -> Response:
        arrived = received_at(request)
        request_id = request.path_params["request_id"]
        try:
            body = AnswerIn.model_validate(await read_json(request, MAX_TOKEN_CHARS * 4))
        except ValidationError as exc:
            raise refuse_validation(exc) from None
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise Refusal(404, "unknown_request", "no such approval request", answer=approvals.UNKNOWN)
        if self.before_answer is not None:
            await self.before_answer(request)
        given = ApprovalAnswer(body.answer)
        try:
            known = await self.misses.worth_looking_up(request_id)
            standing = await asyncio.to_thread(self._answer, request_id, given, body.token, arrived) if known else None
        except PoolTimeout:
            raise unavailable("ledger_unavailable", "no ledger connection available in time") from None
        except psycopg.OperationalError:
            raise unavailable("ledger_unavailable", "the ledger did not answer") from None
        if standing is None:
            self.misses.missed(known)
            # Nothing to wake and nothing stored; the body still says what stands. The token
            # cannot be checked without the request's user, so this answer does not depend on
            # it: it only tells that an unguessable id (the worker's uuid) was never issued.
            raise Refusal(404, "unknown_request", "no such approval request", answer=approvals.UNKNOWN)
        log.info("approval %s: given %s, stands %s", request_id, given.value, standing.answer)
        try:
            await self.publisher.send([approvals.wake_event(standing, arrived)], via="approvals")
        except Refusal as exc:
            # The answer is committed; only the wake-up is missing, and a retry sends it.
            exc.extra["answer"] = standing.answer
            raise
        shown = {"request_id": request_id, "answer": standing.answer, "given": given.value}
        if standing.answer == given:
            return JSONResponse(shown)  # this answer stands (stored now, or a retry of the one stored)
        # Stored or not, this answer did not count: a client that checks the status must know.
        if standing.answer == ApprovalAnswer.EXPIRED:
            raise Refusal(409, "expired", "the answer arrived after the deadline: expired stands", **shown)
        raise Refusal(409, "already_answered", f"an earlier answer stands: {standing.answer}", **shown)
