"""The OpenAPI document of ingest, built from the request models the handlers validate with.

Served at ``/openapi.json`` and kept in the repo as ``services/vigil/ingest/openapi.json``;
a test fails when the two differ, so a change to a model or a route is a change to the
committed contract. Regenerate after such a change with::

    python -m vigil.ingest.openapi --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from vigil.ingest.approvals_api import AnswerIn, AnswerOut
from vigil.ingest.events_api import Accepted, BatchIn, EventIn, MessageIn
from vigil.ingest.mounts import mounted_openapi_paths

COMMITTED = Path(__file__).with_name("openapi.json")
REF = "#/components/schemas/{model}"


def _error(description: str, **headers: str) -> dict:
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}},
    }
    if headers:
        response["headers"] = {
            name: {"schema": {"type": "string"}, "description": text} for name, text in headers.items()
        }
    return response


def _json_body(ref: str | None, description: str) -> dict:
    schema = (
        {"$ref": REF.format(model=ref)}
        if ref
        else {"description": "Any JSON document, exactly as the provider sent it."}
    )
    return {"required": True, "description": description, "content": {"application/json": {"schema": schema}}}


def _ok(status: str, ref: str, description: str) -> dict:
    return {
        status: {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=ref)}}},
        }
    }


REFUSALS = {
    "400": _error("Malformed JSON or a field that fails validation; `field` names it."),
    "413": _error("The body is larger than VIGIL_MAX_BODY_BYTES (refused before it is read whole)."),
    "408": _error("The request head or body did not arrive in time (VIGIL_INGEST_*_TIMEOUT_S); closed."),
    "415": _error("The Content-Type is not application/json."),
    "431": _error("The request line and headers are larger than VIGIL_INGEST_MAX_HEADER_BYTES."),
    "503": _error(
        "The broker (or the ledger) did not acknowledge in time. Nothing was acknowledged; retry.",
        **{"Retry-After": "Seconds to wait before retrying."},
    ),
}
BEARER = {
    "401": _error("Missing or unknown bearer token.", **{"WWW-Authenticate": "Bearer"}),
    "403": _error("The token was revoked, or lacks the scope or the user (`forbidden`)."),
    "429": _error("The token is over VIGIL_INGEST_TOKEN_RATE on this process.", **{"Retry-After": "Seconds to wait."}),
}


def _header(name: str, description: str, required: bool = False) -> dict:
    return {
        "name": name,
        "in": "header",
        "required": required,
        "description": description,
        "schema": {"type": "string"},
    }


def _path(name: str, description: str) -> dict:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def paths() -> dict[str, Any]:
    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    return {
        "/v1/events": {
            "post": {
                "summary": 'Produce events (one envelope, or {"events": [...]})',
                "security": secured,
                "requestBody": _json_body("EventsRequest", "One envelope, or a batch of up to VIGIL_INGEST_MAX_BATCH."),
                "responses": {**_ok("202", "Accepted", "The broker acknowledged every event."), **BEARER, **REFUSALS},
            }
        },
        "/v1/users/{user_id}/messages": {
            "post": {
                "summary": "A chat message from a user to their agent",
                "security": secured,
                "parameters": [
                    _path("user_id", "Whose agent the message is for."),
                    _header(
                        "Idempotency-Key", "The message's dedup key: a client's retry with the same key is one event."
                    ),
                ],
                "requestBody": _json_body("MessageIn", "The message."),
                "responses": {
                    **_ok("202", "Accepted", "The broker acknowledged the message."),
                    "409": {
                        "description": "The message was a clear yes or no to an approval question (the session it "
                        "continues waits on one) and did not count: `expired` or `already_answered`, as for "
                        "POST /v1/approvals/{request_id}. When it counts, the 202 also carries `request_id`, `answer` "
                        "and `given`, and the answer's wake-up is produced instead of the message.",
                        "content": {"application/json": {"schema": {"$ref": REF.format(model="AnswerNotCounted")}}},
                    },
                    "404": _error(
                        "in_reply_to names no delivery to this user (unknown_delivery), or session_id no "
                        "session of this user (unknown_session): another user's is refused the same way."
                    ),
                    **BEARER,
                    **REFUSALS,
                },
            }
        },
        "/v1/hooks/{hook_id}": {
            "post": {
                "summary": "A webhook delivery (GitHub, Stripe or Standard Webhooks, per the hook)",
                "parameters": [
                    _path("hook_id", "The hook `vigil hooks add` created."),
                    _header("X-Hub-Signature-256", "github: sha256=<hex HMAC-SHA256 of the body>."),
                    _header("X-GitHub-Delivery", "github: the delivery id (the dedup key)."),
                    _header("X-GitHub-Event", "github: the event type."),
                    _header("Stripe-Signature", "stripe: t=<unix>,v1=<hex>; the body's id is the dedup key."),
                    _header("webhook-id", "standard-webhooks: the message id (the dedup key)."),
                    _header("webhook-timestamp", "standard-webhooks: Unix seconds, within ±VIGIL_WEBHOOK_TOLERANCE_S."),
                    _header("webhook-signature", "standard-webhooks: v1,<base64> (space separated)."),
                ],
                "requestBody": _json_body(None, "The provider's payload; the signature covers these exact bytes."),
                "responses": {
                    **_ok("202", "Accepted", "Verified and acknowledged by the broker."),
                    **_ok("200", "Accepted", "A GitHub ping: verified, nothing produced (accepted is 0)."),
                    "401": _error("Missing header, bad signature or stale timestamp; `reason` says which."),
                    "404": _error("No such hook (or it is disabled)."),
                    **REFUSALS,
                },
            }
        },
        "/v1/approvals/{request_id}": {
            "post": {
                "summary": "Answer an approval request (a deferred tool call)",
                "parameters": [_path("request_id", "The approval request being answered.")],
                "requestBody": _json_body("AnswerIn", "The answer and the token that came with the question."),
                "responses": {
                    **_ok(
                        "200",
                        "AnswerOut",
                        "This answer stands (stored now, or a retry of it); the session's wake-up was produced.",
                    ),
                    "409": {
                        "description": "This answer did not count: `expired` (it arrived after the deadline, or the "
                        "expiry came first; expired is stored) or `already_answered` (another answer came first). "
                        "`answer` says which stands, `given` echoes this one; the wake-up was produced.",
                        "content": {"application/json": {"schema": {"$ref": REF.format(model="AnswerNotCounted")}}},
                    },
                    "403": _error("The token does not grant an answer to this request. Nothing stored."),
                    "404": _error("No such request: `answer` is `unknown`."),
                    **REFUSALS,
                },
            }
        },
        "/v1/approvals/{request_id}/actions/{answer}": {
            "post": {
                "summary": "Answer an approval request by its signed action URL (a chat app's approve / deny button)",
                "description": "The URL comes whole in the question's delivery (`data.actions[].url`); no body and no "
                "bearer token: the signature is the capability. Single use: only the call that stores the answer "
                "counts.",
                "parameters": [
                    _path("request_id", "The approval request being answered."),
                    _path("answer", "yes or no."),
                    {"name": "expires", "in": "query", "required": True, "schema": {"type": "integer"}},
                    {"name": "signature", "in": "query", "required": True, "schema": {"type": "string"}},
                ],
                "responses": {
                    **_ok("200", "AnswerOut", "This action stored the answer; the session's wake-up was produced."),
                    "409": {
                        "description": "It did not count: `already_used` (an action URL of this request answered "
                        "it), `already_answered` (another path did) or `expired`. The wake-up was produced.",
                        "content": {"application/json": {"schema": {"$ref": REF.format(model="AnswerNotCounted")}}},
                    },
                    "410": _error("The action expired with the approval's deadline (`expired`). Nothing stored."),
                    "403": _error("Forged, altered or incomplete (`invalid_signature`). Nothing stored."),
                    "404": _error("No such request: `answer` is `unknown`."),
                    **REFUSALS,
                },
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": {"description": "The process runs."}}}},
        "/readyz": {
            "get": {
                "summary": "Readiness: 200 while ingest serves; `checks` says whether broker and ledger answer",
                "responses": {
                    "200": {"description": "Serving (a request needing a down dependency gets 503 itself)."},
                    "503": {"description": "Not serving."},
                },
            }
        },
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "Text format."}}}},
    }


def schemas() -> dict[str, Any]:
    _, found = models_json_schema(
        [(model, "validation") for model in (EventIn, BatchIn, MessageIn, AnswerIn)]
        + [(model, "serialization") for model in (Accepted, AnswerOut)],
        ref_template=REF,
    )
    defs = found["$defs"]
    defs["EventsRequest"] = {"oneOf": [{"$ref": REF.format(model="EventIn")}, {"$ref": REF.format(model="BatchIn")}]}
    defs["AnswerNotCounted"] = {"allOf": [{"$ref": REF.format(model="Error")}, {"$ref": REF.format(model="AnswerOut")}]}
    defs["Error"] = {
        "type": "object",
        "required": ["error", "detail"],
        "properties": {
            "error": {"type": "string", "description": "A stable code, e.g. invalid_event, body_too_large."},
            "detail": {"type": "string", "description": "What was wrong, for a person."},
            "field": {"type": "string", "description": "400: the field at fault, e.g. events[3].user_id."},
        },
    }
    return defs


def document(extra_paths: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "vigil ingest",
            "version": "1",
            "description": "Events, chat messages, webhooks and approval answers into vigil. Every "
            'refusal is {"error": code, "detail": ...} and stores nothing (but a late approval answer, '
            "a 409 after which expired stands); 2xx only after the broker acknowledged. A path "
            "parameter is one segment, percent-decoded once: an id with / is sent as %2F (team-a%2Fbob), "
            "a % as %25.",
        },
        "paths": {**paths(), **(extra_paths or {})},
        "components": {
            "schemas": schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "`vigil tokens create NAME`"}
            },
        },
    }


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    # The served document includes the mounted modules' paths; so must the committed one.
    text = render(document(mounted_openapi_paths()))
    if "--write" in sys.argv:
        COMMITTED.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
