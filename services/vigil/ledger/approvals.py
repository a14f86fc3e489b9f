"""The approval rule, in one place: who stands when an answer and the deadline race.

An approval request (a deferred tool call) is answered by a person through ingest, or
expires through its ``approval_expiry`` timer in the scheduler. Both write the same row,
``approvals.request_id``, and only ever out of ``answer IS NULL``: whichever is stored
first stands and the other is a no-op. The answer path checks the deadline itself against
the time the answer was *received*, so an answer that arrived in time is never expired by
queue lag, and a late tap never revives an expired request.

Either path then produces the same wake-up event, keyed ``('approval', request_id)``, so
the owning worker resumes the saved session exactly once whatever raced. The expiry timer
fires that event even when an answer was stored first: if the answer's own wake-up was lost
(ingest crashed after its commit), the deadline delivers it.

Answers are authenticated with a per-request capability token (HMAC of the request id
and user under ``VIGIL_APPROVAL_SECRET``) that goes out with the question.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import DictRow

from vigil.envelope import Event
from vigil.ledger.queries import Q
from vigil.ledger.states import AnsweredVia, ApprovalAnswer, OnExpiry

UNKNOWN = "unknown"  # the answer path's reply for a request never made
TOKEN_VERSION = "v1"


@dataclass(frozen=True)
class Standing:
    """The answer that stands for a request after a write attempt."""

    request_id: str
    answer: str  # yes | no | expired | unknown
    user_id: str | None = None
    session_id: str | None = None
    tool: str | None = None
    tool_use_id: str | None = None
    escalated: bool = False  # the expiry became another ask
    due: datetime | None = None
    escalations: int = 0  # times asked again so far
    answered_via: str | None = None  # api | chat | action | operator; None: the expiry's, or open
    stored: bool = False  # this call stored the answer (a retry or a second use did not)


def _standing(
    conn: psycopg.Connection[DictRow], request_id: str, escalated: bool = False, stored: bool = False
) -> Standing:
    row = conn.execute(Q.approval_get, {"request_id": request_id}).fetchone()
    if row is None:
        return Standing(request_id, UNKNOWN)
    row = dict(row) if not isinstance(row, dict) else row
    return Standing(
        request_id,
        row["answer"] or "pending",
        row["user_id"],
        row["session_id"],
        row["tool"],
        row["tool_use_id"],
        escalated,
        row["due"],
        row["escalations"],
        row["answered_via"],
        stored,
    )


def standing(conn: psycopg.Connection[DictRow], request_id: str) -> Standing:
    """What stands for a request now, without writing; ``answer`` is ``unknown`` for a request
    never made and ``pending`` for an open one."""
    return _standing(conn, request_id)


def answerable_ids(conn: psycopg.Connection[DictRow], since: datetime) -> frozenset[str]:
    """The request ids an answer may name: open ones, and those due after ``since``."""
    return frozenset(row["request_id"] for row in conn.execute(Q.approval_ids_answerable, {"since": since}))


def answer(
    conn: psycopg.Connection[DictRow],
    request_id: str,
    given: ApprovalAnswer,
    received_at: datetime,
    via: AnsweredVia = AnsweredVia.API,
) -> Standing:
    """Store a person's answer (call inside a transaction; produce the wake-up after commit).

    In time (``received_at`` before the deadline) and first: it stands. Late and first: the
    request is stored as expired. Second: whatever was stored first stands. Every path a
    person answers by (``via``: the API, a chat reply, an action URL) goes through here, so
    they share one race rule; ``Standing.stored`` says whether this call stored the answer.
    """
    if given not in (ApprovalAnswer.YES, ApprovalAnswer.NO):
        raise ValueError("a person answers yes or no")
    params = {
        "request_id": request_id,
        "answer": given.value,
        "received_at": received_at,
        "at": received_at,
        "via": via.value,
    }
    if conn.execute(Q.approval_answer_in_time, params).fetchone() is not None:
        return _standing(conn, request_id, stored=True)
    stored = conn.execute(Q.approval_expire, params).fetchone() is not None
    return _standing(conn, request_id, stored=stored)


def open_request_of_session(conn: psycopg.Connection[DictRow], *, user_id: str, session_id: str) -> str | None:
    """The request id a session of this user waits on, if any (a chat reply naming it answers it)."""
    row = conn.execute(Q.approval_open_for_session, {"user_id": user_id, "session_id": session_id}).fetchone()
    return None if row is None else row["request_id"]


def request_of_reply(
    conn: psycopg.Connection[DictRow], *, user_id: str, session_id: str, delivery_id: UUID | None
) -> str | None:
    """The request a chat reply of this user answers, open or not (issue 58: a late or second
    answer is told what stands, as the API tells it, instead of running as a new turn).

    In order: the request the delivery it names (``in_reply_to``) asked; the one its session
    waits on; naming only the session, the one the session's newest message asked (the agent
    said nothing since). None: the reply answers nothing, and is an ordinary message."""
    if delivery_id is not None:
        row = conn.execute(Q.approval_asked_by_delivery, {"user_id": user_id, "delivery_id": delivery_id}).fetchone()
        if row is not None:
            return str(row["request_id"])
    found = open_request_of_session(conn, user_id=user_id, session_id=session_id)
    if found is not None or delivery_id is not None:
        return found
    row = conn.execute(Q.approval_asked_last_in_session, {"user_id": user_id, "session_id": session_id}).fetchone()
    return None if row is None else row["request_id"]


def expire(conn: psycopg.Connection[DictRow], request_id: str, at: datetime, escalate_after: timedelta) -> Standing:
    """The deadline passed (the scheduler's expiry timer; call inside a transaction).

    Applies the request's policy: ``deny`` stores expired; ``approve`` stores yes;
    ``escalate`` moves the deadline by ``escalate_after`` and reports ``escalated`` (the
    wake-up asks again, louder), at every deadline: it fails closed, waiting until a person
    answers or an operator denies (``vigil approvals deny``), never running the tool on
    silence. If an answer was already stored, nothing is written and that answer is reported.
    """
    params = {"request_id": request_id, "at": at, "received_at": None, "via": None}
    escalated = conn.execute(Q.approval_escalate, {**params, "new_due": at + escalate_after}).fetchone()
    if escalated is not None:
        return _standing(conn, request_id, escalated=True)
    if conn.execute(Q.approval_approve_on_expiry, params).fetchone() is None:
        conn.execute(Q.approval_expire, params)
    return _standing(conn, request_id)


def wake_event(standing: Standing, received_at: datetime | None = None) -> Event:
    """The event that resumes the session. One key per request, so a duplicate is dropped;
    an escalation has its own key (it is a second question, not the answer)."""
    now = received_at or datetime.now(UTC)
    if standing.escalated:
        # Each escalation is its own question: its own key (the first keeps the plain one).
        n = standing.escalations
        source_id = f"{standing.request_id}/escalation" + (f"/{n}" if n > 1 else "")
        kind = "approval.escalate"
    else:
        source_id, kind = standing.request_id, "approval.answer"
    payload = {
        "request_id": standing.request_id,
        "answer": standing.answer,
        "tool": standing.tool,
        "tool_use_id": standing.tool_use_id,
    }
    if standing.due is not None:
        payload["due"] = standing.due.isoformat()
    return Event(
        user_id=standing.user_id or "",
        source="approval",
        source_id=source_id,
        kind=kind,
        payload=json.dumps(payload),
        received_at=now,
        session_id=standing.session_id,
    )


def operator_deny(conn: psycopg.Connection[DictRow], request_id: str, at: datetime) -> tuple[bool, Standing]:
    """An operator decides an open request: it counts as a no (call inside a transaction).

    The request's expiry timer is moved to ``at`` (now), so the scheduler's next pass produces the
    wake-up with the standing answer (as it does after any answer) and the session resumes
    with the denial. Returns whether this call denied it, and the standing answer (already
    answered: nothing changes).
    """
    row = conn.execute(Q.approval_operator_deny, {"request_id": request_id}).fetchone()
    if row is not None:
        user_id = row["user_id"] if isinstance(row, dict) else row[0]
        conn.execute(Q.approval_expiry_now, {"user_id": user_id, "request_id": request_id, "at": at})
    return row is not None, _standing(conn, request_id)


def args_hash(tool: str, arguments: dict[str, Any]) -> str:
    """sha256 of the tool name and its exact arguments (canonical JSON)."""
    canonical = json.dumps(
        {"tool": tool, "input": arguments}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def sign_token(*, secret: str, request_id: str, user_id: str) -> str:
    """The capability that lets the addressee, and only them, answer this request."""
    mac = hmac.new(secret.encode(), f"{TOKEN_VERSION}|{request_id}|{user_id}".encode(), hashlib.sha256).digest()
    return f"{TOKEN_VERSION}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


def verify_token(*, secret: str, request_id: str, user_id: str, token: str) -> bool:
    return hmac.compare_digest(
        sign_token(secret=secret, request_id=request_id, user_id=user_id).encode(), token.encode()
    )


def sign_action(*, secret: str, request_id: str, user_id: str, given: ApprovalAnswer, expires: int) -> str:
    """The signature of one answer action: this request, this user, this answer, until ``expires``
    (Unix seconds, the deadline the question carried). Its own message (``action``), so neither
    an answer token nor the other action's signature passes for it."""
    message = f"{TOKEN_VERSION}|action|{request_id}|{user_id}|{given.value}|{expires}"
    mac = hmac.new(secret.encode(), message.encode(), hashlib.sha256).digest()
    # The token's shape ("v1." and 43 base64url characters): the log channel's redaction hides it too.
    return f"{TOKEN_VERSION}.{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


def verify_action(
    *, secret: str, request_id: str, user_id: str, given: ApprovalAnswer, expires: int, signature: str
) -> bool:
    expected = sign_action(secret=secret, request_id=request_id, user_id=user_id, given=given, expires=expires)
    return hmac.compare_digest(expected.encode(), signature.encode())


ACTION_LABELS = {ApprovalAnswer.YES: ("approve", "Approve"), ApprovalAnswer.NO: ("deny", "Deny")}


def answer_actions(*, secret: str, request_id: str, user_id: str, due: datetime, base_url: str) -> list[dict[str, Any]]:
    """The approve and deny actions a question's delivery carries, for a chat app's buttons:
    ``POST`` to ``url`` (``base_url`` + the path; no body, no bearer token: the signature is
    the capability), valid until ``expires_at``, and once (the ledger stores one answer)."""
    expires = int(due.timestamp())
    actions = []
    for given, (action_id, label) in ACTION_LABELS.items():
        signature = sign_action(secret=secret, request_id=request_id, user_id=user_id, given=given, expires=expires)
        path = f"/v1/approvals/{request_id}/actions/{given.value}?expires={expires}&signature={signature}"
        actions.append(
            {
                "id": action_id,
                "label": label,
                "answer": given.value,
                "method": "POST",
                "url": base_url.rstrip("/") + path,
                "request_id": request_id,
                "expires_at": due.isoformat(),
            }
        )
    return actions


__all__ = [
    "Standing",
    "answer",
    "expire",
    "wake_event",
    "args_hash",
    "sign_token",
    "verify_token",
    "sign_action",
    "verify_action",
    "answer_actions",
    "OnExpiry",
    "UNKNOWN",
]


async def create(
    conn: psycopg.AsyncConnection[DictRow],
    *,
    request_id: str,
    user_id: str,
    session_id: str | None,
    run_id: int | None,
    tool: str,
    tool_use_id: str,
    args_hash: str,
    due: datetime,
    on_expiry: OnExpiry,
) -> None:
    """A tool call that needs approval: written by the worker's fenced finish."""
    await conn.execute(
        Q.approval_create,
        {
            "request_id": request_id,
            "user_id": user_id,
            "session_id": session_id,
            "run_id": run_id,
            "tool": tool,
            "tool_use_id": tool_use_id,
            "args_hash": args_hash,
            "due": due,
            "on_expiry": str(on_expiry),
        },
    )


@dataclass(frozen=True, slots=True)
class RequestRow:
    """`vigil approvals list`'s row."""

    request_id: str
    user_id: str
    session_id: str | None
    tool: str
    due: datetime
    on_expiry: str
    escalations: int
    answer: str | None
    answered_at: datetime | None
    created_at: datetime


def list_requests(
    conn: psycopg.Connection[DictRow], user_id: str | None, include_answered: bool, limit: int
) -> list[RequestRow]:
    """Requests newest first: only the open ones unless ``include_answered``; one user's if ``user_id``."""
    rows = conn.execute(Q.approvals_list, {"user_id": user_id, "all": include_answered, "limit": limit}).fetchall()
    return [RequestRow(**row) for row in rows]
