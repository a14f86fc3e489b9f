"""The background tasks HTTP API, mounted on ingest (``vigil.ingest.mounts.MOUNTED``).

Only the owner chain may read, wait on or cancel a task, checked on every call: the caller's
token must act for the task's user (:func:`may_act_for`: the ``messages`` scope for that
user, or ``admin``), and that user must be the task's creator or an owner in its chain
(:func:`vigil.ledger.tasks.may_own`). Never the session. Anyone else gets a 403 and learns
nothing more.

- ``GET /v1/users/{user_id}/tasks``: the user's tasks, newest first (``?status=``,
  ``?limit=`` up to 200, ``?before=<created_at>`` for the next page).
- ``GET /v1/tasks/{task_id}``: one task, every column (the result once it has one).
  ``?wait=S`` (0 to 60): a long-poll, answered as soon as the task is terminal, else after S
  seconds with the task as it is (the row read again every ``WAIT_POLL_S``).
- ``POST /v1/tasks/{task_id}/cancel``, or ``DELETE /v1/tasks/{task_id}``: cancel it. A
  queued task is cancelled at once (200); a running one is flagged and stopped by its worker
  at its next heartbeat (202); a terminal one is left as it is (409, with its status).
  Audited with the token's name.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vigil.envelope import id_problem
from vigil.ingest.auth import Caller, permits
from vigil.ledger import audit
from vigil.ledger import tasks as ledger
from vigil.ledger.states import Scope, TaskStatus
from vigil.numbers import NotParsed, instant, whole_number

TASK_ID = re.compile(r"^tsk_[0-9a-f]{20}$")
DEFAULT_PAGE = 50
MAX_PAGE = 200
MAX_WAIT_S = 60
WAIT_POLL_S = 0.5
COLLECTION = "/v1/users/{user_id}/tasks"
ITEM = "/v1/tasks/{task_id}"
CANCEL = "/v1/tasks/{task_id}/cancel"


def may_act_for(caller: Caller, user_id: str) -> bool:
    """The owner-chain rule for tasks: may this caller act for this user's work?

    A task belongs to the conversation that delegated it, so whoever may talk to the agent
    for the user (the ``messages`` scope, for that user) may read, wait on and cancel it;
    ``admin`` tokens act for everyone (:func:`vigil.ingest.auth.permits`)."""
    return permits(caller, Scope.MESSAGES, user_id)


def routes(ctx: Any) -> list[Route]:
    def forbidden(user_id: str) -> Exception:
        return ctx.Refusal(403, "forbidden", "this token may not act for the task's user")

    async def owned(request: Request) -> tuple[Caller, ledger.TaskRow]:
        caller = await ctx.authenticate(request)
        task_id = request.path_params["task_id"]
        if not TASK_ID.match(task_id):
            raise ctx.Refusal(404, "not_found", "no such task")
        task = await ctx.first_found(lambda conn: ledger.get(conn, task_id))
        if task is None:
            raise ctx.Refusal(404, "not_found", "no such task")
        if not may_act_for(caller, task.user_id) or not ledger.may_own(task, [task.user_id]):
            raise forbidden(task.user_id)
        return caller, task

    async def list_tasks(request: Request) -> Response:
        caller = await ctx.authenticate(request)
        user_id = request.path_params["user_id"]
        problem = id_problem(user_id)  # the one id rule (it allowed 200 characters: issue 58)
        if problem is not None:
            raise ctx.invalid("user_id", problem)
        if not may_act_for(caller, user_id):
            raise forbidden(user_id)
        status = request.query_params.get("status")
        if status is not None and status not in {s.value for s in TaskStatus}:
            raise ctx.invalid("status", f"one of {', '.join(s.value for s in TaskStatus)}")
        try:
            limit = whole_number(request.query_params.get("limit", str(DEFAULT_PAGE)), 1, MAX_PAGE)
        except NotParsed as exc:
            raise ctx.invalid("limit", str(exc)) from None
        before = request.query_params.get("before")
        try:
            before_at = instant(before) if before else None  # a task's created_at, as listed
        except NotParsed as exc:
            raise ctx.invalid("before", str(exc)) from None
        async with ctx.ledger(user_id) as conn:
            rows = await ledger.of_user(conn, user_id=user_id, status=status, before=before_at, limit=limit)
        body: dict[str, Any] = {"tasks": [row.as_json() for row in rows]}
        if len(rows) == limit:
            body["next_before"] = rows[-1].created_at.isoformat()
        return JSONResponse(body)

    async def get_task(request: Request) -> Response:
        _, task = await owned(request)
        try:
            wait_s = whole_number(request.query_params.get("wait", "0"), 0, MAX_WAIT_S)
        except NotParsed as exc:
            raise ctx.invalid("wait", str(exc)) from None
        until = time.monotonic() + wait_s
        while task.finished_at is None and time.monotonic() < until:
            await asyncio.sleep(min(WAIT_POLL_S, max(until - time.monotonic(), 0.0)))
            async with ctx.ledger(task.user_id) as conn:  # held for one read, never across the wait
                task = await ledger.get(conn, task.id) or task
        return JSONResponse(task.as_json())

    async def audit_cancel(conn, caller: Caller, changed: ledger.TaskRow) -> None:
        detail = {"task_id": changed.id, "status": str(changed.status), "token_id": caller.token_id}
        await audit.record_async(conn, actor=caller.name, action="task.cancel", detail=detail)

    async def cancel_task(request: Request) -> Response:
        caller, task = await owned(request)
        async with ctx.ledger(task.user_id) as conn:
            changed = await ledger.cancel(conn, task_id=task.id, actor=caller.name)
            if changed is not None and not ctx.sharded:
                await audit_cancel(conn, caller, changed)
        if changed is not None and ctx.sharded:
            # The audit trail is the catalog's: its own transaction once the cancel committed
            # on the user's shard (a crash between them loses the audit line, not the cancel).
            async with ctx.ledger() as conn:
                await audit_cancel(conn, caller, changed)
        if changed is None:
            async with ctx.ledger(task.user_id) as conn:
                now = await ledger.get(conn, task.id)
            status = now.status if now else task.status
            if task.mode == "sync" and status == TaskStatus.RUNNING:
                raise ctx.Refusal(409, "conflict", "the task is a sync child: it ends with its run, not on its own")
            raise ctx.Refusal(409, "conflict", f"the task is already {status}")
        code = 200 if changed.status == TaskStatus.CANCELLED else 202
        return JSONResponse(changed.as_json(), status_code=code)

    return [
        ctx.route(COLLECTION, list_tasks, methods=["GET"]),
        ctx.route(ITEM, get_task, methods=["GET"]),
        ctx.route(ITEM, cancel_task, methods=["DELETE"]),
        ctx.route(CANCEL, cancel_task, methods=["POST"]),
    ]


def openapi_paths() -> dict[str, Any]:
    """The tasks API for ingest's ``/openapi.json``."""
    user = {"name": "user_id", "in": "path", "required": True, "schema": {"type": "string"}}
    task = {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string", "pattern": TASK_ID.pattern}}
    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    denied = {"description": "the token may not act for the task's user"}
    missing = {"description": "no such task"}
    statuses = [s.value for s in TaskStatus]
    cancelled = {
        "200": {"description": "cancelled (it had not started)"},
        "202": {"description": "running: its worker stops it at its next heartbeat"},
        "403": denied,
        "404": missing,
        "409": {"description": "already terminal"},
    }
    return {
        COLLECTION: {
            "get": {
                "summary": "List a user's background tasks, newest first",
                "security": secured,
                "parameters": [
                    user,
                    {
                        "name": "status",
                        "in": "query",
                        "schema": {"type": "string", "enum": statuses},
                    },
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}},
                    {"name": "before", "in": "query", "schema": {"type": "string", "format": "date-time"}},
                ],
                "responses": {"200": {"description": "the tasks"}, "400": {"description": "bad query"}, "403": denied},
            }
        },
        ITEM: {
            "get": {
                "summary": "One background task",
                "security": secured,
                "parameters": [
                    task,
                    {"name": "wait", "in": "query", "schema": {"type": "integer", "minimum": 0, "maximum": MAX_WAIT_S}},
                ],
                "responses": {
                    "200": {"description": "the task (with wait: once terminal, or after wait seconds)"},
                    "400": {"description": "bad wait"},
                    "403": denied,
                    "404": {"description": "no such task"},
                },
            },
            "delete": {
                "summary": "Cancel a background task (as POST .../cancel)",
                "security": secured,
                "parameters": [task],
                "responses": cancelled,
            },
        },
        CANCEL: {
            "post": {
                "summary": "Cancel a background task",
                "security": secured,
                "parameters": [task],
                "responses": cancelled,
            }
        },
    }
