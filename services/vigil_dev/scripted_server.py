"""The offline Claude: a local server that speaks the Anthropic Messages API and answers from a script.

Point the real ``anthropic`` SDK at it (``base_url=`` or ``ANTHROPIC_BASE_URL``) and the
worker's real request building, the real wire format and the SDK's own response and error
parsing are all exercised, without a network or an API key worth anything.

Run it::

    python -m vigil_dev.scripted_server --script FILE.json --host 127.0.0.1 --port 8765

(``--script`` defaults to ``demo_script.json`` next to this module.)  From pytest::

    with ScriptedServer(script) as server:          # or: url = server.start() ... server.stop()
        client = anthropic.Anthropic(base_url=server.base_url, api_key="test")
        ...
        server.requests()                           # every /v1/messages body received, in order

Endpoints
---------
``POST /v1/messages``
    Non-streaming Messages API.  The request is checked the way the real API checks it
    cheaply (credentials and ``anthropic-version`` headers, model / max_tokens / messages,
    non-empty content, every ``tool_use`` answered by a ``tool_result`` in the next message
    and vice versa, unique tool names, at most 4 ``cache_control`` breakpoints), so a worker
    that builds a transcript the real API would reject is caught offline too.  Credentials
    are ``x-api-key`` or ``Authorization: Bearer``: SDK 2.x sends an ``api_key`` as the latter.
``GET /_requests`` / ``DELETE /_requests``
    Every request body received (parsed JSON, in order, including rejected ones) / forget them.
``GET /_script`` / ``PUT /_script``
    Read / replace the script at runtime; replacing also resets the ``times`` counters.

Nothing here logs request bodies or headers: tests put secrets in them and then check that
the secrets appear nowhere.

Prompt caching
--------------
The request is read as a sequence of blocks: each tool, then each system block, then each
message content block.  Blocks carrying ``cache_control`` (or the last block, when the
request has a top-level ``cache_control``) are breakpoints.  Each breakpoint's prefix is
written to an in-memory cache keyed by the hash of its canonical JSON (``cache_control``
markers themselves excluded, as moving a marker does not change the cached content).  On
the next request, the longest prefix found in the cache, looking back up to 20 blocks from
each breakpoint as the real API does, is reported as ``cache_read_input_tokens``; the rest
up to the last breakpoint as ``cache_creation_input_tokens``; the remainder as
``input_tokens``.  Entries live 5 minutes (``"ttl": "1h"``: an hour) from their last use.
Token counts are estimates: UTF-8 bytes / 4.

The script
----------
A JSON object (a bare list is read as its ``rules``)::

    {
      "cache_min_tokens": 0,        # optional: prefixes shorter than this are not cached
      "rules": [ RULE, ... ]        # tried in order; the first that matches answers
    }

A rule::

    {
      "name": "remind",             # optional, shows up in the server's log
      "when": {                     # every condition given must hold; no "when" = always
        "user_text": REGEX,         # text of the last user turn: text blocks and tool_result
                                    #   content, joined by newlines
        "tool_result": "NAME",      # the last user turn holds a tool_result for a tool_use of
                                    #   tool NAME in the assistant turn before it
        "tool_result_text": REGEX,  # ... whose content matches
        "tool_result_error": BOOL,  # ... whose is_error is this
        "system": REGEX,            # the system prompt's text
        "history": REGEX,           # text of the user turns before the last one (a resumed
                                    #   session's earlier conversation), joined by newlines
        "model": REGEX              # the requested model
      },
      "reply": [                    # content blocks of the answer; [] is a valid answer
        {"type": "text", "text": "Hello {name}"},
        {"type": "tool_use", "name": "send_message", "input": {"text": "{1}", "urgent": false}}
      ],
      "stop_reason": "max_tokens",  # optional: default tool_use if the reply calls a tool,
                                    #   else end_turn (max_tokens when the reply is longer
                                    #   than the request's max_tokens; it is then cut)
      "error": {                    # instead of "reply": answer with an API error
        "status": 429,              #   429 rate_limit_error, 529 overloaded_error,
        "type": "rate_limit_error", #   500 api_error, 400 invalid_request_error, ...
        "message": "slow down",     #   (type and message default from the status)
        "retry_after": 1            #   retry-after header on 429/529 (default 1 second)
      },
      "times": 2,                   # optional: the rule answers at most this many requests
      "delay": 0.5,                 # optional: seconds to wait before answering, or
                                    #   [low, high]: a uniformly drawn wait per request
      "hold": "PATH"                # optional: after the delay, the answer also waits until
    }                               #   the file PATH exists (a load's held wave: every
                                    #   process of a --load group sees the same file)

A REGEX is a Python regular expression (``re.search``; use inline flags such as ``(?i)`` or
``(?s)``), or a list of them that must all match.  Their groups can be substituted into any
string of the reply: ``{0}`` (whole match), ``{1}``, ``{name}``; with several regexes in one
rule, later ones (model, system, history, user_text, tool_result_text, in that order) win on clashes,
so prefer named groups.  ``{{`` and ``}}`` are literal braces; unknown names stay as they
are.  A string that is exactly ``{name:int}`` or ``{name:float}`` becomes that number.

A rule whose reply calls a tool the request does not offer (not in ``tools``, or
``tool_choice`` is ``none``) is skipped, as the real model could not call it.  When no rule
matches, the answer is a 500 ``api_error`` with ``x-should-retry: false``: a gap in the
script, not an outage.

Example: rate limited twice, then a tool call, then done::

    {"rules": [
      {"times": 2, "error": {"status": 429}},
      {"when": {"tool_result": "send_message"}, "reply": []},
      {"when": {"user_text": "(?i)hello (?P<who>\\\\w+)"},
       "reply": [{"type": "tool_use", "name": "send_message",
                  "input": {"text": "Hi {who}!", "urgent": false}}]},
      {"reply": [{"type": "text", "text": "Nothing to do."}]}
    ]}
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import re
import socket
import string
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

# Named explicitly: under `python -m` __name__ would be "__main__".
log = logging.getLogger("vigil_dev.scripted_server")

DEMO_SCRIPT_PATH = Path(__file__).with_name("demo_script.json")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}
_WHEN_KEYS = {"user_text", "tool_result", "tool_result_text", "tool_result_error", "system", "model", "history"}
_RULE_KEYS = {"name", "when", "reply", "stop_reason", "error", "times", "delay", "hold"}
_HOLD_POLL_S = 0.05
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{(\w+)(?::(int|float))?\}")
_TYPED_PLACEHOLDER = re.compile(r"^\{(\w+):(int|float)\}$")
_ID_ALPHABET = string.ascii_letters + string.digits
_CACHE_LOOKBACK_BLOCKS = 20
_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
# Real requests carry some framing the caller cannot cache; keeps input_tokens above zero.
_FRAMING_TOKENS = 3
_CACHE_SWEEP_S = 1.0


class ScriptError(ValueError):
    """The script is malformed."""


class ApiError(Exception):
    """Raised inside a handler to answer with an error in the real API's shape."""

    def __init__(
        self, status: int, message: str, error_type: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or _ERROR_TYPES.get(status, "api_error")
        self.headers = headers or {}


def _new_id(prefix: str) -> str:
    # Shaped like the real ids (e.g. toolu_01A09q90qw90lq917835lq9) so nothing keys on format.
    # Unique, not secret: the fast generator (the model-bound bench asks for thousands a second).
    return prefix + "01" + "".join(random.choices(_ID_ALPHABET, k=22))


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _tokens(nbytes: int) -> int:
    return nbytes // 4


# ---------------------------------------------------------------------------- the script


@dataclass
class _Rule:
    index: int
    name: str
    when: dict[str, Any]
    reply: list[dict[str, Any]]
    error: dict[str, Any] | None
    stop_reason: str | None
    times: int | None
    delay: tuple[float, float]  # (low, high): seconds before answering, drawn per request
    hold: str | None = None  # a file that must exist before the answer goes

    @property
    def label(self) -> str:
        return f"rule {self.index}" + (f" ({self.name})" if self.name else "")

    def tool_names(self) -> set[str]:
        return {b["name"] for b in self.reply if b["type"] == "tool_use"}


def _compile_regexes(value: Any, where: str) -> list[re.Pattern[str]]:
    patterns = value if isinstance(value, list) else [value]
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise ScriptError(f"{where}: expected a regex or a non-empty list of regexes")
    try:
        return [re.compile(p) for p in patterns]
    except re.error as exc:
        raise ScriptError(f"{where}: bad regex: {exc}") from None


def _compile_rule(index: int, raw: Any) -> _Rule:
    where = f"rules[{index}]"
    if not isinstance(raw, dict):
        raise ScriptError(f"{where}: expected an object")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise ScriptError(f"{where}: unknown keys {sorted(unknown)}")

    when_raw = raw.get("when") or {}
    if not isinstance(when_raw, dict):
        raise ScriptError(f"{where}.when: expected an object")
    unknown = set(when_raw) - _WHEN_KEYS
    if unknown:
        raise ScriptError(f"{where}.when: unknown conditions {sorted(unknown)}")
    when: dict[str, Any] = {}
    for key in ("user_text", "tool_result_text", "system", "model", "history"):
        if key in when_raw:
            when[key] = _compile_regexes(when_raw[key], f"{where}.when.{key}")
    if "tool_result" in when_raw:
        if not isinstance(when_raw["tool_result"], str):
            raise ScriptError(f"{where}.when.tool_result: expected a tool name")
        when["tool_result"] = when_raw["tool_result"]
    if "tool_result_error" in when_raw:
        if not isinstance(when_raw["tool_result_error"], bool):
            raise ScriptError(f"{where}.when.tool_result_error: expected true or false")
        when["tool_result_error"] = when_raw["tool_result_error"]

    error = raw.get("error")
    if "reply" in raw and error is not None:
        raise ScriptError(f"{where}: give either reply or error, not both")
    if error is not None:
        if not isinstance(error, dict) or not isinstance(error.get("status", 0), int):
            raise ScriptError(f"{where}.error: expected an object with an integer status")
        status = error.get("status", 500)
        if not 400 <= status <= 599:
            raise ScriptError(f"{where}.error.status: {status} is not an error status")
        error = {
            "status": status,
            "type": error.get("type") or _ERROR_TYPES.get(status, "api_error"),
            "message": error.get("message") or f"scripted {status}",
            "retry_after": error.get("retry_after", 1),
        }

    reply = raw.get("reply", [])
    if not isinstance(reply, list):
        raise ScriptError(f"{where}.reply: expected a list of content blocks")
    for j, block in enumerate(reply):
        bwhere = f"{where}.reply[{j}]"
        if not isinstance(block, dict) or block.get("type") not in ("text", "tool_use"):
            raise ScriptError(f"{bwhere}: expected a text or tool_use block")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise ScriptError(f"{bwhere}: a text block needs a string text")
        if block["type"] == "tool_use" and (
            not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict)
        ):
            raise ScriptError(f"{bwhere}: a tool_use block needs a name and an object input")

    stop_reason = raw.get("stop_reason")
    if stop_reason is not None and stop_reason not in _STOP_REASONS:
        raise ScriptError(f"{where}.stop_reason: one of {sorted(_STOP_REASONS)}")
    times = raw.get("times")
    if times is not None and (not isinstance(times, int) or isinstance(times, bool) or times < 0):
        raise ScriptError(f"{where}.times: expected a non-negative integer")
    delay = _delay(raw.get("delay", 0), where)
    hold = raw.get("hold")
    if hold is not None and (not isinstance(hold, str) or not hold):
        raise ScriptError(f"{where}.hold: expected a file path")
    return _Rule(index, str(raw.get("name", "")), when, reply, error, stop_reason, times, delay, hold)


def _delay(raw: Any, where: str) -> tuple[float, float]:
    """A fixed wait (a number) or a range to draw each request's wait from ([low, high]):
    real answers take longer or shorter, and a fixed one keeps a backlog's runs in lockstep."""
    bounds = raw if isinstance(raw, list) and len(raw) == 2 else [raw, raw]
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b >= 0 for b in bounds):
        raise ScriptError(f"{where}.delay: expected a non-negative number of seconds or [low, high]")
    low, high = float(bounds[0]), float(bounds[1])
    if high < low:
        raise ScriptError(f"{where}.delay: [low, high] with low <= high")
    return low, high


def compile_script(script: Any) -> tuple[list[_Rule], dict[str, Any]]:
    """Check a script and compile its regexes; raises ScriptError with where it went wrong."""
    if isinstance(script, list):
        script = {"rules": script}
    if not isinstance(script, dict) or not isinstance(script.get("rules"), list):
        raise ScriptError('a script is {"rules": [...]} or a list of rules')
    min_tokens = script.get("cache_min_tokens", 0)
    if not isinstance(min_tokens, int) or min_tokens < 0:
        raise ScriptError("cache_min_tokens: expected a non-negative integer")
    rules = [_compile_rule(i, raw) for i, raw in enumerate(script["rules"])]
    return rules, {"cache_min_tokens": min_tokens}


def load_script(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------- validation


def _cache_control_ttl(block: Any) -> float | None:
    if not isinstance(block, dict) or not block.get("cache_control"):
        return None
    cc = block["cache_control"]
    return _TTL_SECONDS.get(cc.get("ttl", "5m"), 300.0) if isinstance(cc, dict) else 300.0


def _content_blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content


def _validate(body: Any) -> None:
    """The checks the real API makes before any model runs; messages mimic the real ones."""
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ApiError(400, "model: Field required")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise ApiError(400, "max_tokens: Field required")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, "max_tokens: Input should be greater than or equal to 1")
    if body.get("stream"):
        raise ApiError(400, "stream: the scripted server answers non-streaming requests only")
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "messages: Field required")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: at least one message is required")

    breakpoints = 0
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            for k, block in enumerate(system):
                if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                    raise ApiError(400, f"system.{k}: Input should be a text block")
                breakpoints += _cache_control_ttl(block) is not None
        elif not isinstance(system, str):
            raise ApiError(400, "system: Input should be a valid string or list of text blocks")

    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise ApiError(400, "tools: Input should be a valid list")
    names: set[str] = set()
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not _TOOL_NAME.match(tool["name"]):
            raise ApiError(400, f"tools.{k}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'")
        if tool["name"] in names:
            raise ApiError(400, "tools: Tool names must be unique.")
        names.add(tool["name"])
        if tool.get("type") in (None, "custom") and not isinstance(tool.get("input_schema"), dict):
            raise ApiError(400, f"tools.{k}.custom.input_schema: Field required")
        breakpoints += _cache_control_ttl(tool) is not None

    choice = body.get("tool_choice")
    if choice is not None and (
        not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none")
    ):
        raise ApiError(
            400, "tool_choice: Input tag does not match any of the expected tags: 'auto', 'any', 'tool', 'none'"
        )

    last = len(messages) - 1
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages.{i}: Input should be an object")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}.role: Input should be 'user' or 'assistant'")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise ApiError(400, f"messages.{i}.content: Input should be a valid string or list")
        if not content and not (i == last and role == "assistant"):
            raise ApiError(
                400,
                f"messages.{i}: all messages must have non-empty content"
                " except for the optional final assistant message",
            )
        for j, block in enumerate(_content_blocks(content)):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise ApiError(400, f"messages.{i}.content.{j}: Input should be a content block object")
            kind = block["type"]
            if kind == "text" and (not isinstance(block.get("text"), str) or not block["text"]):
                raise ApiError(400, "messages: text content blocks must be non-empty")
            if kind == "tool_use" and role != "assistant":
                raise ApiError(400, f"messages.{i}.content.{j}: tool_use blocks can only be in assistant messages")
            if kind == "tool_result" and role != "user":
                raise ApiError(400, f"messages.{i}.content.{j}: tool_result blocks can only be in user messages")
            if kind == "tool_use" and (not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str)):
                raise ApiError(400, f"messages.{i}.content.{j}.tool_use: id and name are required")
            if kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
                raise ApiError(400, f"messages.{i}.content.{j}.tool_result.tool_use_id: Field required")
            breakpoints += _cache_control_ttl(block) is not None
        if i == last and role == "assistant" and isinstance(content, list) and content:
            tail = content[-1]
            if tail.get("type") == "text" and tail["text"] != tail["text"].rstrip():
                raise ApiError(400, "messages: final assistant content cannot end with trailing whitespace")

    # The pairing rule is what a worker's transcript building most often gets wrong.
    for i, message in enumerate(messages):
        blocks = _content_blocks(message["content"])
        if message["role"] == "assistant":
            use_ids = [b["id"] for b in blocks if b["type"] == "tool_use"]
            if not use_ids:
                continue
            nxt = messages[i + 1] if i < last else None
            answered = set()
            if nxt is not None and nxt["role"] == "user":
                answered = {b["tool_use_id"] for b in _content_blocks(nxt["content"]) if b["type"] == "tool_result"}
            missing = [u for u in use_ids if u not in answered]
            if missing:
                raise ApiError(
                    400,
                    f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                    f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                    "in the next message.",
                )
        else:
            prev = messages[i - 1] if i > 0 else None
            offered = set()
            if prev is not None and prev["role"] == "assistant":
                offered = {b["id"] for b in _content_blocks(prev["content"]) if b["type"] == "tool_use"}
            for j, block in enumerate(blocks):
                if block["type"] == "tool_result" and block["tool_use_id"] not in offered:
                    raise ApiError(
                        400,
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                        f"{block['tool_use_id']}. Each `tool_result` block must have a corresponding `tool_use` "
                        "block in the previous message.",
                    )

    if body.get("cache_control"):
        breakpoints += 1
    if breakpoints > 4:
        raise ApiError(400, f"A maximum of 4 blocks with cache_control may be provided. Found {breakpoints}.")


# ---------------------------------------------------------------------------- matching


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


@dataclass
class _ToolResult:
    name: str | None
    text: str
    is_error: bool


@dataclass
class _Turn:
    """What the rules look at, read once from the request."""

    model: str
    system: str
    user_text: str
    tool_results: list[_ToolResult]
    offered_tools: set[str]
    history: str = ""

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> _Turn:
        messages = body["messages"]
        user_index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
        texts: list[str] = []
        results: list[_ToolResult] = []
        if user_index is not None:
            names: dict[str, str] = {}
            if user_index > 0 and messages[user_index - 1]["role"] == "assistant":
                for b in _content_blocks(messages[user_index - 1]["content"]):
                    if b["type"] == "tool_use":
                        names[b["id"]] = b["name"]
            for b in _content_blocks(messages[user_index]["content"]):
                if b["type"] == "text":
                    texts.append(b["text"])
                elif b["type"] == "tool_result":
                    text = _result_text(b.get("content"))
                    texts.append(text)
                    results.append(_ToolResult(names.get(b["tool_use_id"]), text, bool(b.get("is_error"))))

        earlier = [
            _result_text(b.get("content")) if b["type"] == "tool_result" else b.get("text", "")
            for m in messages[:user_index]
            if m["role"] == "user"
            for b in _content_blocks(m["content"])
            if b["type"] in ("text", "tool_result")
        ]
        system = body.get("system") or ""
        if isinstance(system, list):
            system = "\n".join(b["text"] for b in system)

        choice = body.get("tool_choice") or {}
        offered = set() if choice.get("type") == "none" else {t["name"] for t in body.get("tools") or []}
        return cls(body["model"], system, "\n".join(texts), results, offered, "\n".join(earlier))


def _groups(match: re.Match[str]) -> dict[str, str]:
    found = {str(n): (g or "") for n, g in enumerate(match.groups(), start=1)}
    found["0"] = match.group(0)
    found.update({k: (v or "") for k, v in match.groupdict().items()})
    return found


def _search_all(patterns: list[re.Pattern[str]], text: str) -> dict[str, str] | None:
    captures: dict[str, str] = {}
    for pattern in patterns:
        match = pattern.search(text)
        if match is None:
            return None
        captures.update(_groups(match))
    return captures


def _match(rule: _Rule, turn: _Turn) -> dict[str, str] | None:
    """The rule's captures if it matches the turn, else None."""
    when = rule.when
    captures: dict[str, str] = {}
    for key, text in (
        ("model", turn.model),
        ("system", turn.system),
        ("history", turn.history),
        ("user_text", turn.user_text),
    ):
        if key in when:
            found = _search_all(when[key], text)
            if found is None:
                return None
            captures.update(found)

    if {"tool_result", "tool_result_text", "tool_result_error"} & when.keys():
        for result in turn.tool_results:
            if "tool_result" in when and result.name != when["tool_result"]:
                continue
            if "tool_result_error" in when and result.is_error != when["tool_result_error"]:
                continue
            found = _search_all(when["tool_result_text"], result.text) if "tool_result_text" in when else {}
            if found is not None:
                captures.update(found)
                break
        else:
            return None

    if not rule.tool_names() <= turn.offered_tools:
        return None
    return captures


def _substitute(value: Any, captures: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _substitute(v, captures) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, captures) for v in value]
    if not isinstance(value, str):
        return value

    typed = _TYPED_PLACEHOLDER.match(value)
    if typed and typed.group(1) in captures:
        raw = captures[typed.group(1)]
        try:
            return int(raw) if typed.group(2) == "int" else float(raw)
        except ValueError:
            return raw

    def replace(m: re.Match[str]) -> str:
        token = m.group(0)
        if token in ("{{", "}}"):
            return token[0]
        return captures.get(m.group(1), token)

    return _PLACEHOLDER.sub(replace, value)


def _build_content(rule: _Rule, captures: dict[str, str], max_tokens: int) -> tuple[list[dict[str, Any]], str]:
    content: list[dict[str, Any]] = []
    for block in rule.reply:
        if block["type"] == "text":
            content.append({"type": "text", "text": _substitute(block["text"], captures)})
        else:
            content.append(
                {
                    "type": "tool_use",
                    "id": _new_id("toolu_"),
                    "name": block["name"],
                    "input": _substitute(block.get("input", {}), captures),
                }
            )

    if _tokens(len(_canonical(content))) > max_tokens:
        # The model stops mid-output: text is cut, a tool call that does not fit never appears.
        budget, kept = max_tokens * 4, []
        for block in content:
            size = len(_canonical(block))
            if size <= budget:
                kept.append(block)
                budget -= size
            elif block["type"] == "text" and budget > 0:
                kept.append({"type": "text", "text": block["text"].encode()[:budget].decode(errors="ignore")})
                break
            else:
                break
        return kept, "max_tokens"

    if rule.stop_reason:
        return content, rule.stop_reason
    return content, "tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"


# ---------------------------------------------------------------------------- state


def _strip_cache_control(block: Any) -> Any:
    if isinstance(block, dict) and "cache_control" in block:
        return {k: v for k, v in block.items() if k != "cache_control"}
    return block


def _prompt_blocks(body: dict[str, Any]) -> list[tuple[bytes, float | None]]:
    """The request as cacheable blocks, in the order the real API caches them."""
    out: list[tuple[bytes, float | None]] = []
    for tool in body.get("tools") or []:
        out.append((_canonical(["tool", _strip_cache_control(tool)]), _cache_control_ttl(tool)))
    system = body.get("system")
    for block in _content_blocks(system) if system else []:
        out.append((_canonical(["system", _strip_cache_control(block)]), _cache_control_ttl(block)))
    for i, message in enumerate(body["messages"]):
        for block in _content_blocks(message["content"]):
            out.append((_canonical([i, message["role"], _strip_cache_control(block)]), _cache_control_ttl(block)))
    top = body.get("cache_control")
    if top and out:
        ttl = _TTL_SECONDS.get(top.get("ttl", "5m"), 300.0) if isinstance(top, dict) else 300.0
        out[-1] = (out[-1][0], out[-1][1] or ttl)
    return out


class _Backend:
    """Script, counters, recorded requests and prompt cache, shared by the server thread and tests."""

    def __init__(self, script: Any, keep_requests: bool = True) -> None:
        self._lock = threading.Lock()
        # Off for load (the benchmark's model-bound workload): thousands of bodies kept for
        # nobody to read would grow the server without bound.
        self._keep_requests = keep_requests
        self._requests: list[Any] = []
        self._cache: dict[bytes, float] = {}  # prefix digest -> expiry (monotonic)
        self._next_sweep = 0.0
        self.set_script(script)

    def set_script(self, script: Any) -> None:
        rules, options = compile_script(script)
        with self._lock:
            self._script = json.loads(json.dumps(script))
            self._rules = rules
            self._options = options
            self._uses = [0] * len(rules)

    def script(self) -> Any:
        with self._lock:
            return json.loads(json.dumps(self._script))

    def record(self, body: Any) -> None:
        if not self._keep_requests:
            return
        with self._lock:
            self._requests.append(body)

    def requests(self) -> list[Any]:
        with self._lock:
            # A copy, so a test cannot change what the next test sees.
            return json.loads(json.dumps(self._requests))

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def choose(self, turn: _Turn) -> tuple[_Rule, dict[str, str]] | None:
        with self._lock:
            for rule in self._rules:
                if rule.times is not None and self._uses[rule.index] >= rule.times:
                    continue
                captures = _match(rule, turn)
                if captures is not None:
                    self._uses[rule.index] += 1
                    return rule, captures
        return None

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        blocks = _prompt_blocks(body)
        digests: list[bytes] = []
        cumulative: list[int] = []
        running, total = hashlib.sha256(), 0
        for data, _ in blocks:
            running.update(data + b"\x1e")
            digests.append(running.copy().digest())
            total += len(data)
            cumulative.append(total)
        breakpoints = [i for i, (_, ttl) in enumerate(blocks) if ttl is not None]
        all_tokens = _tokens(total)

        empty = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
        if not breakpoints or _tokens(cumulative[breakpoints[-1]]) < self._options["cache_min_tokens"]:
            return {
                "input_tokens": all_tokens + _FRAMING_TOKENS,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "cache_creation": empty,
            }

        with self._lock:
            now = time.monotonic()
            # Expired entries are swept once a second, not on every request: with one cached
            # prefix per conversation, a sweep per request cost the server a scan of every
            # conversation's entry per call. Lookups check the expiry themselves.
            if now >= self._next_sweep:
                for key in [k for k, expiry in self._cache.items() if expiry <= now]:
                    del self._cache[key]
                self._next_sweep = now + _CACHE_SWEEP_S
            hit = -1
            for bp in breakpoints:
                for pos in range(bp, max(-1, bp - _CACHE_LOOKBACK_BLOCKS), -1):
                    if self._cache.get(digests[pos], 0.0) > now:
                        hit = max(hit, pos)
                        break
            last = breakpoints[-1]
            if hit >= 0:
                self._cache[digests[hit]] = max(self._cache[digests[hit]], now + 300.0)
            for bp in breakpoints:
                self._cache[digests[bp]] = max(self._cache.get(digests[bp], 0.0), now + blocks[bp][1])

        read = _tokens(cumulative[hit]) if hit >= 0 else 0
        cached = _tokens(cumulative[last])
        creation = cached - read
        bucket = "ephemeral_1h_input_tokens" if blocks[last][1] >= 3600 else "ephemeral_5m_input_tokens"
        return {
            "input_tokens": all_tokens - cached + _FRAMING_TOKENS,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": read,
            "cache_creation": {**empty, bucket: creation},
        }


# ---------------------------------------------------------------------------- HTTP


def _error_response(err: ApiError, request_id: str) -> JSONResponse:
    headers = {"request-id": request_id, **err.headers}
    body = {"type": "error", "error": {"type": err.error_type, "message": err.message}, "request_id": request_id}
    return JSONResponse(body, status_code=err.status, headers=headers)


def _check_headers(request: Request) -> None:
    auth = request.headers.get("authorization", "")
    if not request.headers.get("x-api-key") and not auth.lower().startswith("bearer "):
        raise ApiError(401, "x-api-key header is required")
    if not request.headers.get("anthropic-version"):
        raise ApiError(400, "anthropic-version: header is required")


async def _create_message(request: Request) -> Response:
    backend: _Backend = request.app.state.backend
    request_id = _new_id("req_")
    try:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            raise ApiError(400, "There was an error parsing the body of your request as JSON") from None
        backend.record(body)
        _check_headers(request)
        _validate(body)

        turn = _Turn.from_body(body)
        chosen = backend.choose(turn)
        if chosen is None:
            log.warning("no script rule matched request %s", request_id)
            raise ApiError(
                500, "scripted server: no script rule matched this request", headers={"x-should-retry": "false"}
            )
        rule, captures = chosen
        log.info("request %s answered by %s", request_id, rule.label)
        low, high = rule.delay
        if high:
            await asyncio.sleep(random.uniform(low, high))
        while rule.hold is not None and not os.path.exists(rule.hold):
            await asyncio.sleep(_HOLD_POLL_S)

        if rule.error is not None:
            headers = {}
            if rule.error["status"] in (429, 529):
                headers["retry-after"] = str(rule.error["retry_after"])
            raise ApiError(rule.error["status"], rule.error["message"], rule.error["type"], headers)

        content, stop_reason = _build_content(rule, captures, body["max_tokens"])
        usage = backend.usage(body)
        usage["output_tokens"] = max(1, _tokens(len(_canonical(content))))
        usage["service_tier"] = "standard"
        message = {
            "id": _new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }
        return JSONResponse(message, headers={"request-id": request_id})
    except ApiError as err:
        return _error_response(err, request_id)
    except Exception as exc:  # noqa: BLE001 - the default handler would log a traceback built from the body
        log.error("scripted server failed on request %s: %s", request_id, type(exc).__name__)
        return _error_response(ApiError(500, f"scripted server error: {type(exc).__name__}"), request_id)


async def _requests_endpoint(request: Request) -> Response:
    backend: _Backend = request.app.state.backend
    if request.method == "DELETE":
        backend.clear()
        return Response(status_code=204)
    return JSONResponse(backend.requests())


async def _script_endpoint(request: Request) -> Response:
    backend: _Backend = request.app.state.backend
    if request.method == "GET":
        return JSONResponse(backend.script())
    try:
        backend.set_script(json.loads(await request.body()))
    except (ValueError, ScriptError) as exc:
        return _error_response(ApiError(400, f"bad script: {exc}"), _new_id("req_"))
    return Response(status_code=204)


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error_response(ApiError(404, "Not found"), _new_id("req_"))


def create_app(script: Any, keep_requests: bool = True) -> Starlette:
    """An ASGI app answering the Messages API from ``script`` (see the module docstring).
    ``keep_requests=False``: ``GET /_requests`` stays empty (for load, where nobody reads them)."""
    app = Starlette(
        routes=[
            Route("/v1/messages", _create_message, methods=["POST"]),
            Route("/_requests", _requests_endpoint, methods=["GET", "DELETE"]),
            Route("/_script", _script_endpoint, methods=["GET", "PUT"]),
        ],
        exception_handlers={404: _not_found, 405: _not_found},
    )
    app.state.backend = _Backend(script, keep_requests)
    return app


class ScriptedServer:
    """The scripted server on a free 127.0.0.1 port in a background thread, for tests."""

    def __init__(self, script: Any = None, host: str = "127.0.0.1", port: int = 0) -> None:
        if script is None:
            script = load_script(DEMO_SCRIPT_PATH)
        self.app = create_app(script)
        self._backend: _Backend = self.app.state.backend
        self._host = host
        self._port = port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.base_url = ""

    def start(self, timeout: float = 10.0) -> str:
        if self._thread is not None:
            return self.base_url
        # Binding here, not in uvicorn, gives the port before the thread starts and no race for it.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        self._socket = sock
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,  # leave the test process's logging alone
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"scripted-claude-{port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("scripted server did not start")
            time.sleep(0.01)
        self.base_url = f"http://{self._host}:{port}"
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def requests(self) -> list[Any]:
        return self._backend.requests()

    def clear(self) -> None:
        self._backend.clear()

    def set_script(self, script: Any) -> None:
        self._backend.set_script(script)

    def __enter__(self) -> ScriptedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vigil_dev.scripted_server",
        description="Serve the Anthropic Messages API from a script, offline.",
    )
    parser.add_argument("--script", type=Path, default=DEMO_SCRIPT_PATH, help="script JSON (default: the demo script)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--load",
        action="store_true",
        help="for load tests: keep no request bodies (GET /_requests stays empty), no access log, keep idle "
        "connections 60 s, and bind with SO_REUSEPORT so several server processes can share the port",
    )
    args = parser.parse_args(argv)

    try:
        app = create_app(load_script(args.script), keep_requests=not args.load)
    except (OSError, ValueError) as exc:
        parser.error(f"{args.script}: {exc}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.load:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((args.host, args.port))
    # uvicorn's 5 s keep-alive would close a worker's idle connections between waves of runs
    # and make it pay a handshake the real API (behind long-lived load balancers) does not ask for.
    config = uvicorn.Config(
        app, log_level=args.log_level, access_log=False, backlog=4096, timeout_keep_alive=60, lifespan="off"
    )
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
