"""Deferred tool calls: asking, asking again, and resuming with the answer.

Asking (a call whose permission is ``ask``) ends the run. What the run returns, all
committed together by the worker's fenced finish:

1. the session, state ``waiting``, its transcript ending on the assistant turn that made
   the call, and ``pending``: the call (tool, exact input, tool_use id), the request id,
   the argument hash, and the results of the other calls of that turn, already made;
2. the approval request (:class:`NewApproval`) with the hash of the exact arguments
   (:func:`vigil.ledger.approvals.args_hash`), the deadline and the expiry policy;
3. its expiry timer (kind ``approval_expiry``, fixed key = request id, so the expiry and
   the answer produce the same wake-up event and only the first counts);
4. an urgent message with the question, the request id and the signed answer token, and
   the approve / deny actions (signed single-use answer URLs expiring with the deadline).

A crash before the commit leaves none of it (the claim is retried and asks afresh).

Resuming (an ``approval.answer`` event naming the session): the standing answer comes from
the ``approvals`` row, not the event. ``yes``: the permission is checked again, the hash of
the arguments about to run must equal the approved one, and the tool runs once with the
request id as idempotency key; ``no`` / ``expired``: the tool result says so. Either way
the model continues from the complete tool-result turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

from vigil.agent import metrics
from vigil.agent.base import ApprovalRequest, NewApproval, NewTimer, OutMessage
from vigil.agent.permissions import Gate
from vigil.agent.prompt import tool_result
from vigil.agent.tools import ActionTool, CallContext
from vigil.ledger.approvals import answer_actions, args_hash, sign_token
from vigil.ledger.states import OnExpiry, TimerKind

MAX_REASON_CHARS = 400
_ON_EXPIRY_WORDS = {
    OnExpiry.DENY: "it counts as a no",
    OnExpiry.ESCALATE: "you will be asked again until you answer; nothing happens meanwhile",
    OnExpiry.APPROVE: "it goes ahead",
}


@dataclass(frozen=True)
class Deferral:
    pending: dict[str, Any]
    approval: NewApproval
    timer: NewTimer
    question: OutMessage


def _whole_second(when: datetime) -> datetime:
    return datetime.fromtimestamp(math.ceil(when.timestamp()), UTC)


def question_text(pending: dict[str, Any], user_id: str, secret: str, *, again: bool = False) -> str:
    request_id = pending["request_id"]
    policy = _ON_EXPIRY_WORDS.get(OnExpiry(pending["on_expiry"]), "it counts as a no")
    lines = [
        ("STILL WAITING FOR YOUR ANSWER: " if again else "Approval needed: ") + pending["summary"],
    ]
    if pending.get("reason"):
        lines.append(f"Why: {pending['reason']}")
    lines += [
        f"Reply yes or no to this message before {pending['due']}; without an answer {policy}.",
        f'Or through the API: POST /v1/approvals/{request_id} with {{"answer": "yes" or "no", "token": <token below>}}',
        f"request_id: {request_id}",
        f"token: {sign_token(secret=secret, request_id=request_id, user_id=user_id)}",
    ]
    return "\n".join(lines)


def _question(
    pending: dict[str, Any], user_id: str, secret: str, actions_base_url: str, *, again: bool = False
) -> OutMessage:
    due = datetime.fromisoformat(pending["due"])
    actions = answer_actions(
        secret=secret, request_id=pending["request_id"], user_id=user_id, due=due, base_url=actions_base_url
    )
    text = question_text(pending, user_id, secret, again=again)
    return OutMessage(text, urgent=True, deadline=due, actions=tuple(actions))


def defer(
    tool: ActionTool,
    use: dict[str, Any],
    turn: list[dict[str, Any]],
    results: list[dict[str, Any]],
    *,
    user_id: str,
    session_id: str,
    now: datetime,
    deadline_s: int,
    on_expiry: OnExpiry,
    secret: str,
    actions_base_url: str = "",
) -> Deferral:
    """Everything that asks the user about ``use`` (a tool_use block of the last turn)."""
    request_id = f"apr-{uuid4().hex}"
    due = _whole_second(now + timedelta(seconds=deadline_s))
    digest = args_hash(tool.name, use["input"])
    said = " ".join(b["text"] for b in turn if b.get("type") == "text").strip()
    pending = {
        "request_id": request_id,
        "tool_use_id": use["id"],
        "tool": tool.name,
        "input": use["input"],
        "args_hash": digest,
        "due": due.isoformat(),
        "on_expiry": on_expiry.value,
        "summary": tool.describe(use["input"]),
        "reason": said[:MAX_REASON_CHARS],
        "order": [b["id"] for b in turn if b.get("type") == "tool_use"],
        "results": results,
    }
    metrics.APPROVALS_REQUESTED.labels(tool.name, "ask").inc()
    return Deferral(
        pending=pending,
        approval=NewApproval(request_id, session_id, tool.name, use["id"], digest, due, on_expiry),
        timer=NewTimer(
            f"approval-{request_id}",
            due,
            TimerKind.APPROVAL_EXPIRY.value,
            {"request_id": request_id},
            fixed_key=request_id,
        ),
        question=replace(_question(pending, user_id, secret, actions_base_url), session_id=session_id),
    )


def escalate(
    pending: dict[str, Any], due: str | None, user_id: str, secret: str, actions_base_url: str = ""
) -> tuple[dict[str, Any], OutMessage]:
    """The same question again, louder, with the deadline the escalation moved (and actions
    that expire with it: the first question's have expired)."""
    updated = {**pending, "due": due or pending["due"]}
    metrics.APPROVALS_REQUESTED.labels(pending["tool"], "escalate").inc()
    return updated, _question(updated, user_id, secret, actions_base_url, again=True)


def resumed_turn(pending: dict[str, Any], resolved: dict[str, Any]) -> list[dict[str, Any]]:
    """The complete tool-result turn: the other calls' results and this one, in call order."""
    by_id = {b["tool_use_id"]: b for b in pending["results"]}
    by_id[resolved["tool_use_id"]] = resolved
    return [by_id[i] for i in pending["order"] if i in by_id]


async def resolve(
    pending: dict[str, Any],
    request: ApprovalRequest | None,
    *,
    user_id: str,
    session_id: str,
    gate: Gate,
    tools: dict[str, ActionTool],
) -> tuple[dict[str, Any], str]:
    """The tool_result for the deferred call given the standing answer; runs it if approved.

    Returns (tool_result block, decision for the metrics).
    """
    use_id, name, request_id = pending["tool_use_id"], pending["tool"], pending["request_id"]

    def result(text: str, decision: str, is_error: bool = True) -> tuple[dict[str, Any], str]:
        metrics.TOOL_CALLS.labels(name, decision).inc()
        return tool_result(use_id, text, is_error), decision

    if (
        request is None
        or request.session_id != session_id
        or request.tool != name
        or request.answer not in ("yes", "no", "expired")
    ):
        return result(
            f"Not done: the answer to request {request_id} could not be verified, so it counts as denied.", "declined"
        )
    if request.answer == "no":
        return result(f"Not done: the person denied this request ({request_id}).", "declined")
    if request.answer == "expired":
        return result(
            f"Not done: the approval request {request_id} expired without an answer, so it counts as denied.",
            "declined",
        )
    tool = tools.get(name)
    if tool is None or not gate.may_run_approved(name):
        return result(f"Not done: {name} is no longer permitted, although the person approved it.", "refused_on_resume")
    digest = args_hash(name, pending["input"])
    if digest != request.args_hash or digest != pending["args_hash"]:
        return result(
            "Not done: the arguments about to run differ from the ones the person approved. "
            "Ask again with the arguments you mean if it is still needed.",
            "refused_on_resume",
        )
    refusal = tool.check(pending["input"])
    if refusal is not None:
        return result(f"Not done: {refusal}.", "refused_on_resume")
    output = await tool.run(pending["input"], CallContext(user_id, use_id, idempotency_key=request_id))
    return result(f"Approved by the person. {output.text}", "approved", output.is_error)
