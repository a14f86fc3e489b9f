"""One model call, with the run's budgets and the retry policy for API failures.

- 429 (rate limited), 529 (overloaded), other 5xx and connection failures are transient:
  retried here with exponential backoff and jitter, never shorter than the server's
  ``retry-after``, up to ``VIGIL_MODEL_RETRIES`` times and never past the run's deadline.
  Then :class:`RetryLater`: the worker releases the claim with a backoff, without counting
  an attempt toward the poison bound, because an API outage is not the event's fault.
- A 5xx that says ``x-should-retry: false``, and every 4xx but 429 (a malformed request,
  a bad key, a prompt too long), is the run's own problem: it propagates and the attempt
  counts as failed, so a request that can never succeed ends dead instead of looping.

- Every attempt passes the fleet's gate (``CallPolicy.gate``, :mod:`vigil.agent.fleet`): the
  back-off a 429 or 529 told any worker, and the fleet-wide bound on calls in flight.

The SDK's own retries are switched off (``max_retries=0``) so that this is the only policy
and its attempts show in the metrics.

The request goes out through the SDK's ``request`` with a body vigil encodes itself
(:class:`Request`): ``messages.create`` deep-copies and re-encodes the whole request on every
call, tools and system prompt included, which were a third of a worker's CPU per model-bound
run. The tools are encoded once per agent, the system prompt once per run
(:class:`Encoded`), the request options once per client (:func:`_options`); headers,
authentication, the status errors and the transport are still the SDK's. The call's span
(GenAI conventions) is vigil's own, when traces are on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, cast

import anthropic
import httpx2
import pydantic
import pydantic_core
from anthropic._models import FinalRequestOptions, construct_type
from anthropic.types import Message
from opentelemetry.trace import SpanKind

from vigil import tracing
from vigil.agent import metrics
from vigil.agent.base import RetryLater, Usage
from vigil.agent.fleet import OPEN, Gate
from vigil.ledger.budgets import billed
from vigil.retry import backoff, retry_after_seconds

log = logging.getLogger(__name__)

PATH = "/v1/messages"
# A call is not started with less time than this left: it would be cut off mid-answer.
MIN_CALL_SECONDS = 5.0
# A call is not started with fewer tokens than this left in the run's budget.
MIN_CALL_TOKENS = 256
# The answers that slow the whole fleet down (the shared back-off, vigil.agent.fleet).
SLOW_DOWN = frozenset({"rate_limited", "overloaded"})


@dataclass
class Budget:
    """The run's limits and what it has spent."""

    max_turns: int
    max_tokens: int
    deadline: float  # time.monotonic()
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    tool_calls: int = 0  # tool_use blocks received: recorded on the run, not a limit
    reserved: int = 0  # tokens set aside for the background tasks this run queued (their budgets)
    profile: str = "default"  # the agent profile, for vigil_model_tokens_total

    @property
    def spent(self) -> int:
        """Billed tokens, weighted as the daily budget weighs them (cache reads 0.1x, writes 1.25x)."""
        return billed(self)

    @property
    def left(self) -> int:
        """Tokens this run may still spend itself or hand to a child."""
        return self.max_tokens - self.spent - self.reserved

    def exhausted(self) -> str | None:
        """Which budget stops the next call, or None."""
        if self.turns >= self.max_turns:
            return "turns"
        if self.left < MIN_CALL_TOKENS:
            return "tokens"
        if self.deadline - time.monotonic() < MIN_CALL_SECONDS:
            return "wall_time"
        return None

    def add(self, usage: Any, billed: bool = True) -> None:
        """Count a model turn. ``billed=False``: a replayed turn, paid for by an earlier
        attempt (it counts against the run's budget, not in the billing metrics again)."""
        self.turns += 1
        counts = {
            "input": usage.input_tokens or 0,
            "output": usage.output_tokens or 0,
            "cache_read": getattr(usage, "cache_read_input_tokens", None) or 0,
            "cache_write": getattr(usage, "cache_creation_input_tokens", None) or 0,
        }
        self.input_tokens += counts["input"]
        self.output_tokens += counts["output"]
        self.cache_read_tokens += counts["cache_read"]
        self.cache_write_tokens += counts["cache_write"]
        if not billed:
            return
        for kind, n in counts.items():
            if n:
                metrics.model_tokens(self.profile, kind).inc(n)

    def usage(self) -> Usage:
        return Usage(
            self.turns,
            self.input_tokens,
            self.output_tokens,
            self.cache_read_tokens,
            self.cache_write_tokens,
            self.tool_calls,
        )


@dataclass(frozen=True)
class CallPolicy:
    """How one model call is made and retried: attempts, backoff, timeout, the fleet's gate."""

    retries: int
    backoff_s: float
    backoff_cap_s: float
    timeout_s: float
    gate: Gate = OPEN  # the fleet's (vigil.agent.fleet): shared back-off, fleet-wide slots


def _transient(exc: Exception) -> tuple[bool, str, float | None]:
    """(retry?, metric label, server's retry-after) for a failed call."""
    if isinstance(exc, anthropic.APIConnectionError):  # includes timeouts
        return True, "connection_error", None
    if isinstance(exc, anthropic.APIStatusError):
        status = exc.status_code
        if status == 429:
            return True, "rate_limited", retry_after_seconds(exc.response.headers, time.time())
        if status == 529:
            return True, "overloaded", retry_after_seconds(exc.response.headers, time.time())
        if status >= 500:
            if exc.response.headers.get("x-should-retry") == "false":
                return False, "server_error", None
            return True, "server_error", retry_after_seconds(exc.response.headers, time.time())
        return False, "client_error", None
    return False, "other_error", None


def prepare() -> None:
    """Build the ``Message`` validator now: pydantic defers it to first use, which would put
    its cost (tens of milliseconds, more on a busy machine) on the first run's answer."""
    Message.model_rebuild(force=True)


def _dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, by pydantic-core's encoder: a fifth of the stdlib's CPU on a
    conversation, whose messages are encoded on every call (docs/performance.md, "Model-bound
    runs", change 12)."""
    return pydantic_core.to_json(value)


@dataclass(frozen=True, slots=True)
class Encoded:
    """A part of requests encoded once: the tools (the same on every call of every run, and
    most of a request's size) and a run's system prompt (the same on each of its calls). The
    same bytes every time: the cached prefix must not move."""

    value: Any
    encoded: bytes

    @classmethod
    def of(cls, value: Any) -> Encoded:
        return cls(value, _dumps(value))


@dataclass(slots=True)
class Request:
    """One Messages API request (the fields vigil sends)."""

    model: str
    max_tokens: int
    system: Encoded
    messages: list[dict[str, Any]]
    tools: Encoded | None = None

    def body(self) -> bytes:
        parts = [
            b'{"model":',
            _dumps(self.model),
            b',"max_tokens":',
            str(int(self.max_tokens)).encode(),
            b',"system":',
            self.system.encoded,
            b',"messages":',
            _dumps(self.messages),
        ]
        if self.tools is not None and self.tools.value:
            parts += [b',"tools":', self.tools.encoded]
        parts.append(b"}")
        return b"".join(parts)


async def _message(response: httpx2.Response) -> Message:
    """The answer as the SDK's ``Message``, validated from its bytes by pydantic-core.

    The SDK's own reading builds the same objects leniently in Python, about five times the
    CPU (a third of a millisecond and more per answer, two answers per run). Anything the
    strict schema refuses (a content block type newer than this SDK) is read leniently, as
    the SDK does. The SDK has already raised for error statuses by now.
    """
    body = await response.aread()
    try:
        return Message.model_validate_json(body)
    except pydantic.ValidationError:
        return cast(Message, construct_type(type_=Message, value=json.loads(body)))  # the SDK's lenient reader


_urls: weakref.WeakKeyDictionary[anthropic.AsyncAnthropic, httpx2.URL] = weakref.WeakKeyDictionary()
_templates: weakref.WeakKeyDictionary[anthropic.AsyncAnthropic, FinalRequestOptions] = weakref.WeakKeyDictionary()
# The SDK's request logger: at DEBUG it dumps each request's options through pydantic, which
# warns about a parsed URL where the options type a string.
_sdk_log = logging.getLogger("anthropic._base_client")


def _url(client: anthropic.AsyncAnthropic) -> httpx2.URL:
    """The Messages API's absolute URL on the client's base URL (which the SDK keeps ending in
    a slash), parsed once per client. The SDK joins a relative path to its base URL on every
    call, a parse and a copy of the URL (30 us of the 600 a call costs); an absolute string it
    still parses on every call (8 us); a parsed ``URL`` it and httpx only copy (under 1 us).
    (While the SDK logs its requests' options, it gets the string: see ``_sdk_log``.)"""
    url = _urls.get(client)
    if url is None:
        url = _urls[client] = httpx2.URL(str(client.base_url).rstrip("/") + PATH)
    return url


def _options(client: anthropic.AsyncAnthropic) -> FinalRequestOptions:
    """The client's Messages API request options, built once per client. The SDK's ``post``
    constructs them on every call, a pydantic model with twenty fields each given its
    default (17 us; 6.6% of a model-bound worker's samples); a call copies these instead
    (``model_copy`` with its body and timeout, under 2 us). The SDK copies the options it
    is given again before it builds the request, so this template is never changed."""
    options = _templates.get(client)
    if options is None:
        options = _templates[client] = FinalRequestOptions.construct(
            method="post",
            url=_url(client),  # type: ignore[arg-type]  # a parsed URL on purpose: see _url
            json_data=None,
            content=None,
            files=None,
        )
    return options


async def _attempt(client: anthropic.AsyncAnthropic, body: bytes, timeout: float) -> Message:
    """One attempt: the SDK's ``request`` with vigil's body."""
    if _sdk_log.isEnabledFor(logging.DEBUG):
        # The SDK's ``post`` (string URL, options built per call) while it logs them.
        response = await client.post(
            str(_url(client)), cast_to=httpx2.Response, content=body, options={"timeout": timeout}
        )
    else:
        # ``params`` fresh per call: the template's own dict is never handed out.
        options = _options(client).model_copy(update={"content": body, "timeout": timeout, "params": {}})
        response = await client.request(httpx2.Response, options)
    return await _message(response)


async def _post(client: anthropic.AsyncAnthropic, request: Request, body: bytes, timeout: float) -> Message:
    """One attempt, in its span (GenAI conventions) when traces are on."""
    if not tracing.enabled:
        return await _attempt(client, body, timeout)
    # OpenTelemetry's GenAI semantic conventions: the span is named "{operation} {model}";
    # gen_ai.system is the attribute's name before gen_ai.provider.name, still read by many
    # LLM observability tools, so both are set.
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.system": "anthropic",
        "gen_ai.request.model": request.model,
        "gen_ai.request.max_tokens": request.max_tokens,
    }
    with tracing.span(f"chat {request.model}", SpanKind.CLIENT, attributes=attributes) as span:
        try:
            message = await _attempt(client, body, timeout)
        except anthropic.APIStatusError as exc:
            span.set_attribute("error.type", str(exc.status_code))
            raise
        span.set_attribute("gen_ai.response.id", message.id)
        span.set_attribute("gen_ai.response.model", message.model)
        usage = message.usage
        # The conventions count every input token, cached ones included; the API's input_tokens
        # is the uncached rest. The cache parts go beside the total.
        cached = (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
        span.set_attribute("gen_ai.usage.input_tokens", (usage.input_tokens or 0) + cached)
        span.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens or 0)
        if usage.cache_read_input_tokens is not None:
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage.cache_read_input_tokens)
        if usage.cache_creation_input_tokens is not None:
            span.set_attribute("gen_ai.usage.cache_creation.input_tokens", usage.cache_creation_input_tokens)
        if message.stop_reason:
            span.set_attribute("gen_ai.response.finish_reasons", [message.stop_reason])
        return message


async def create(client: anthropic.AsyncAnthropic, request: Request, budget: Budget, policy: CallPolicy) -> Message:
    """One model call with retries; raises RetryLater when the API stays unavailable."""
    body = request.body()
    attempt = 0
    while True:
        started = time.monotonic()
        try:
            async with policy.gate.call(budget.deadline - MIN_CALL_SECONDS):
                started = time.monotonic()
                remaining = budget.deadline - started
                response = await _post(client, request, body, max(1.0, min(policy.timeout_s, remaining)))
        except RetryLater:
            raise  # the fleet's gate: its wait would pass the run's deadline
        except asyncio.CancelledError:
            # The run was cancelled mid-call (a revoke past its grace, a shutdown's release, the
            # run's wall-time limit): the request was sent and may be billed, its answer is lost.
            # Counted, not timed: its duration says nothing about the API.
            metrics.MODEL_REQUESTS_BY_RESULT["cancelled"].inc()
            raise
        except Exception as exc:
            retry, label, retry_after = _transient(exc)
            metrics.MODEL_REQUESTS_BY_RESULT[label].inc()
            metrics.MODEL_SECONDS.observe(time.monotonic() - started)
            if not retry:
                raise
            attempt += 1
            delay = backoff(attempt, policy.backoff_s, policy.backoff_cap_s, retry_after_s=retry_after)
            if label in SLOW_DOWN:
                await policy.gate.told(label, retry_after if retry_after is not None else delay)
            left = budget.deadline - time.monotonic() - MIN_CALL_SECONDS
            if attempt > policy.retries or delay > policy.backoff_cap_s or delay > left:
                log.warning(
                    "model unavailable after %d attempt(s): %s", attempt, label, extra={"event": "model_unavailable"}
                )
                raise RetryLater(f"{label} after {attempt} attempt(s)", retry_after) from exc
            log.info("model call %s, retry %d in %.2fs", label, attempt, delay)
            await asyncio.sleep(delay)
            continue
        metrics.MODEL_REQUESTS_BY_RESULT["ok"].inc()
        metrics.MODEL_SECONDS.observe(time.monotonic() - started)
        return response
