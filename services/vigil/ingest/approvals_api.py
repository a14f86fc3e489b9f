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

Two more paths answer with the same rule, the same wake-up and the same statuses
(``approvals.answered_via`` records which one stored the answer):

- ``POST /v1/approvals/{request_id}/actions/{yes|no}?expires=&signature=``: an action URL
  from the question's delivery (a chat app's button). No body and no bearer token: the
  signature (:func:`vigil.ledger.approvals.sign_action`, over request, user, answer and
  expiry) is the capability. Forged or for another request: 403, nothing written. Past its
  ``expires`` (the deadline the question carried): 410 ``expired``, nothing written.
  Single use: only the call that stores the answer gets a 200; any later use of either
  action is a 409 (``already_used`` when an action URL stored it), because the ledger stores
  one answer per request. POST, not GET: link previews fetch GETs.
- A chat reply (:meth:`ApprovalsApi.answer_reply`, from the messages endpoint): a clear yes
  or no replying to a question (naming its delivery, or a session that waits on it or whose
  newest message it is) answers that request for the authenticated user, or is told the
  answer that stands (409, late or second); the chat text itself is never produced (the
  answer event resumes the session).

The rule lives in :mod:`vigil.ledger.approvals` and is synchronous, so step 2 runs on a
worker thread with a small synchronous pool of its own; approvals are rare next to events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar
from uuid import UUID

import psycopg
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vigil.ingest.events_api import refuse_validation
from vigil.ingest.metrics import UNKNOWN_KEYS
from vigil.ingest.publisher import Publisher
from vigil.ingest.requests import Refusal, read_json, received_at, unavailable
from vigil.ingest.settings import IngestSettings
from vigil.ingest.shards import SyncShardPools
from vigil.ledger import approvals
from vigil.ledger.approvals import Standing
from vigil.ledger.db import PoolTimeout
from vigil.ledger.states import AnsweredVia, ApprovalAnswer
from vigil.numbers import MAX_EPOCH, NotParsed, whole_number
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


T = TypeVar("T")


async def on_ledger(step: Callable[..., T], *args: Any) -> T:
    """``step`` (synchronous ledger work) on a worker thread; a ledger that cannot answer is a 503."""
    try:
        return await asyncio.to_thread(step, *args)
    except PoolTimeout:
        raise unavailable("ledger_unavailable", "no ledger connection available in time") from None
    except psycopg.OperationalError:
        raise unavailable("ledger_unavailable", "the ledger did not answer") from None


class ApprovalsApi:
    def __init__(
        self,
        settings: IngestSettings,
        pools: SyncShardPools,
        publisher: Publisher,
        before_answer: BeforeAnswer | None = None,
    ):
        self.secret = settings.approval_secret.get_secret_value()
        # A request lives on its user's shard; its id names no user, so an answer looks on
        # each shard in turn (one shard: the one pool, as ever).
        self.pools = pools
        self.publisher = publisher
        self.before_answer = before_answer
        # The route needs no API token: a made-up id was a query each (issue 46). As ingest's
        # tokens: past a budget a second, ids are checked against the set of answerable ones.
        self.misses = MissGuard(UNKNOWN_KEYS, "approval", lambda: asyncio.to_thread(self._answerable))

    async def _worth_looking_up(self, request_id: str) -> bool:
        try:
            return await self.misses.worth_looking_up(request_id)
        except PoolTimeout:
            raise unavailable("ledger_unavailable", "no ledger connection available in time") from None
        except psycopg.OperationalError:
            raise unavailable("ledger_unavailable", "the ledger did not answer") from None

    def _answerable(self) -> frozenset[str]:
        since = datetime.now(UTC) - ANSWERABLE_AFTER_DUE
        found: frozenset[str] = frozenset()
        for pool in self.pools.every():
            with pool.connection() as conn:
                found |= approvals.answerable_ids(conn, since)
        return found

    def _store(
        self,
        request_id: str,
        given: ApprovalAnswer,
        arrived: datetime,
        via: AnsweredVia,
        allowed: Callable[[Standing], None],
    ) -> Standing | None:
        """Step 2, one transaction on the shard that holds the request (each looked at in
        turn). None: no such request. ``allowed`` raises a Refusal (a bad token or signature)
        before anything is written."""
        for pool in self.pools.every():
            with pool.connection() as conn:
                with conn.transaction():
                    asked = approvals.standing(conn, request_id)
                    if asked.answer == approvals.UNKNOWN:
                        continue
                    allowed(asked)
                    return approvals.answer(conn, request_id, given, arrived, via)
        return None

    async def _decide(
        self,
        request_id: str,
        given: ApprovalAnswer,
        arrived: datetime,
        via: AnsweredVia,
        allowed: Callable[[Standing], None],
    ) -> Standing:
        """Steps 2 and 3: store (or find what stands), then produce the wake-up either way."""
        known = await self._worth_looking_up(request_id)
        standing = await on_ledger(self._store, request_id, given, arrived, via, allowed) if known else None
        if standing is None:
            self.misses.missed(known)
            # Nothing to wake and nothing stored; the body still says what stands. The token
            # cannot be checked without the request's user, so this answer does not depend on
            # it: it only tells that an unguessable id (the worker's uuid) was never issued.
            raise Refusal(404, "unknown_request", "no such approval request", answer=approvals.UNKNOWN)
        log.info("approval %s: given %s via %s, stands %s", request_id, given.value, via.value, standing.answer)
        try:
            await self.publisher.send([approvals.wake_event(standing, arrived)], via="approvals")
        except Refusal as exc:
            # The answer is committed; only the wake-up is missing, and a retry sends it.
            exc.extra["answer"] = standing.answer
            raise
        return standing

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

        def token_grants(asked: Standing) -> None:
            if not approvals.verify_token(
                secret=self.secret, request_id=request_id, user_id=asked.user_id or "", token=body.token
            ):
                raise Refusal(403, "invalid_token", "the token does not grant an answer to this request")

        standing = await self._decide(request_id, given, arrived, AnsweredVia.API, token_grants)
        return counted(standing, given)

    async def post_action(self, request: Request) -> Response:
        arrived = received_at(request)
        request_id = request.path_params["request_id"]
        word = request.path_params["answer"]
        if len(request_id) > MAX_REQUEST_ID_CHARS or word not in (ApprovalAnswer.YES, ApprovalAnswer.NO):
            raise Refusal(404, "unknown_request", "no such approval action", answer=approvals.UNKNOWN)
        given = ApprovalAnswer(word)
        raw_expires = request.query_params.get("expires", "")
        signature = request.query_params.get("signature", "")
        try:  # ASCII digits only: "②" or "²" pass str.isdigit but not int() (issue 58)
            expires = whole_number(raw_expires, 0, MAX_EPOCH)
        except NotParsed:
            expires = None
        if expires is None or not signature:
            raise Refusal(403, "invalid_signature", "the action URL is incomplete: expires and signature are required")
        if len(signature) > MAX_TOKEN_CHARS:
            raise Refusal(403, "invalid_signature", "the signature does not grant this action")

        def signature_grants(asked: Standing) -> None:
            if not approvals.verify_action(
                secret=self.secret,
                request_id=request_id,
                user_id=asked.user_id or "",
                given=given,
                expires=expires,
                signature=signature,
            ):
                raise Refusal(403, "invalid_signature", "the signature does not grant this action")
            if arrived.timestamp() >= expires:
                # Nothing written: the expiry timer stores what the request's policy says.
                raise Refusal(
                    410,
                    "expired",
                    "the action expired with the approval's deadline",
                    request_id=request_id,
                    given=given.value,
                    expired_at=datetime.fromtimestamp(expires, UTC).isoformat(),
                )

        standing = await self._decide(request_id, given, arrived, AnsweredVia.ACTION, signature_grants)
        return counted(standing, given, single_use=True)

    async def answer_reply(
        self,
        user_id: str,
        session_id: str,
        given: ApprovalAnswer,
        arrived: datetime,
        source_id: str,
        in_reply_to: UUID | None,
    ) -> Response | None:
        """A chat reply's clear yes or no for a session of ``user_id`` (the messages endpoint
        authorized them): answers the request it replies to
        (:func:`vigil.ledger.approvals.request_of_reply`), by the same rule, statuses and
        wake-up as the API: 202 when it counted; late or second, the API's 409 with the
        answer that stands, and the text is not run as a new turn either. None: the reply
        answers no request, and is an ordinary message."""
        request_id = await on_ledger(self._request_of_reply, user_id, session_id, in_reply_to)
        if request_id is None:
            return None

        def same_user(asked: Standing) -> None:
            if asked.user_id != user_id:  # the session is theirs, so its request is: a broken invariant
                raise Refusal(404, "unknown_request", "no such approval request", answer=approvals.UNKNOWN)

        standing = await self._decide(request_id, given, arrived, AnsweredVia.CHAT, same_user)
        return counted(standing, given, 202, accepted=1, source_id=source_id, session_id=session_id)

    def _request_of_reply(self, user_id: str, session_id: str, in_reply_to: UUID | None) -> str | None:
        with self.pools.of_user(user_id).connection() as conn:
            return approvals.request_of_reply(conn, user_id=user_id, session_id=session_id, delivery_id=in_reply_to)


def counted(
    standing: Standing, given: ApprovalAnswer, status: int = 200, *, single_use: bool = False, **extra: Any
) -> Response:
    """``status`` if the answer that stands is the one given (stored now, or a retry of it;
    ``single_use``: stored now only), else a 409 with the same fields: a client that checks
    the status must know its answer did not count."""
    shown: dict[str, Any] = {**extra, "request_id": standing.request_id, "answer": standing.answer}
    shown["given"] = given.value
    if standing.answer == given and (standing.stored or not single_use):
        return JSONResponse(shown, status)
    if standing.answer == ApprovalAnswer.EXPIRED:
        raise Refusal(409, "expired", "the answer arrived after the deadline: expired stands", **shown)
    if single_use and standing.answered_via == AnsweredVia.ACTION:
        raise Refusal(409, "already_used", "an action URL of this request was already used", **shown)
    raise Refusal(409, "already_answered", f"an earlier answer stands: {standing.answer}", **shown)
