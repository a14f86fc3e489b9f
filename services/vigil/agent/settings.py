"""Settings of the Claude agent (``VIGIL_AGENT=claude``), read by the worker at start-up.

Besides the typed fields, two families of variables are read by prefix, like
``VIGIL_KAFKA_OPT_*``:

- ``VIGIL_CREDENTIAL_<NAME>``: a secret the ``http_request`` tool may attach to a request
  when the model names ``<NAME>`` (lower case). The model only ever sees the name.
  ``VIGIL_CREDENTIAL_<NAME>_HOSTS`` narrows the hosts it may be sent to (default: the whole
  allow-list) and ``VIGIL_CREDENTIAL_<NAME>_HEADER`` names the header (default
  ``Authorization``, sent as ``Bearer <secret>``; any other header gets the bare secret).

Every problem is reported naming the variable, and secrets are never shown.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, TypeVar

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator

from vigil.agent.memory import MemoryRefused, confine
from vigil.ledger.states import OnExpiry
from vigil.settings import CommonSettings

CREDENTIAL_PREFIX = "VIGIL_CREDENTIAL_"

# The model id lives here and nowhere else; operators override it with VIGIL_MODEL.
DEFAULT_MODEL = "claude-sonnet-4-5"
# A run is a short wake-up, not a research project: a dozen model calls covers reading
# memory, acting, and replying, and bounds the cost of a model stuck in a tool loop.
DEFAULT_MAX_TURNS = 12
DEFAULT_MAX_RUN_TOKENS = 200_000
DEFAULT_MAX_OUTPUT_TOKENS = 2048
# Below the worker's own run timeout (600 s), so the agent stops cleanly and saves its
# session before the worker cancels it as a failed attempt.
DEFAULT_RUN_WALL_S = 240.0
DEFAULT_MODEL_TIMEOUT_S = 90.0
# Every run in flight holds at most one model connection at a time (its calls are
# sequential), so this matches the worker's default VIGIL_RUN_CONCURRENCY: a run never
# queues for a connection. The SDK's own default (100 kept alive) closed a connection after
# most calls at high concurrency and paid a new TCP handshake for the next one.
DEFAULT_MODEL_MAX_CONNECTIONS = 1000
# Idle model connections are kept this long: longer than the gaps between one worker's calls
# under load, shorter than common load balancers' idle timeouts (60 s and up).
DEFAULT_MODEL_KEEPALIVE_S = 30.0
# The SDK's own defaults for one request's retries; a few attempts ride out a short
# overload, longer ones are the worker's business (RetryLater releases the claim).
DEFAULT_MODEL_RETRIES = 3
DEFAULT_MODEL_BACKOFF_S = 0.5
DEFAULT_MODEL_BACKOFF_CAP_S = 8.0
# About 50k tokens of transcript: past that a session costs more to resume than a fresh
# start from memory.
DEFAULT_SESSION_MAX_BYTES = 200_000
DEFAULT_MEMORY_FILE_MAX_BYTES = 32 * 1024
DEFAULT_MEMORY_TOTAL_MAX_BYTES = 512 * 1024
DEFAULT_MEMORY_MAX_FILES = 200
DEFAULT_INSTRUCTIONS_PATH = "/memories/instructions.md"
DEFAULT_RECENT_MESSAGES = 10
DEFAULT_APPROVAL_DEADLINE_S = 3600
DEFAULT_MAX_MESSAGES_PER_RUN = 5
DEFAULT_MAX_FOLLOWUPS_PER_RUN = 5
DEFAULT_FOLLOWUP_MAX_DELAY_S = 90 * 86_400
DEFAULT_HTTP_TIMEOUT_S = 15.0
DEFAULT_HTTP_MAX_RESPONSE_BYTES = 64 * 1024
DEFAULT_REFUND_AUTO_LIMIT = 50.0
# A classifier answers in one short line; a few seconds bound what it adds to an auto call.
DEFAULT_AUTO_CLASSIFIER_TIMEOUT_S = 5.0
DEFAULT_AUTO_CLASSIFIER_MAX_TOKENS = 64
# An MCP tool call is a remote action like http_request: a bound the model's turn can wait out.
DEFAULT_MCP_TIMEOUT_S = 30.0
# A server down at start-up is listed again this often: a listing that fails at once costs a
# process start (stdio) or a connection, so every few seconds would be waste; half a minute
# bounds how long its tools stay missing after it is back.
DEFAULT_MCP_RETRY_S = 30.0
DEFAULT_MCP_MAX_RESULT_BYTES = 64 * 1024

# Built-in and package tools are lower case; an MCP server's tools keep their own case and hyphens.
_TOOL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
_SERVER_NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")  # no "__": that separates server and tool
_SOURCE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CREDENTIAL_NAME = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")
_HOST = re.compile(r"^[a-z0-9.-]+(:\d{1,5})?$|^\[[0-9a-f:]+\](:\d{1,5})?$")


class Permission(StrEnum):
    ALLOW = "allow"  # runs unattended
    DENY = "deny"  # never offered to the model
    ASK = "ask"  # every call waits for the user's approval (a deferred call)
    AUTO = "auto"  # a policy check blocks risky calls; falls back to ask after repeated blocks


class EventPolicy(StrEnum):
    QUEUE = "queue"  # an event arriving mid-run waits for the next run
    FOLD = "fold"  # claimed at the next model-turn boundary and added to the running conversation
    INTERRUPT = "interrupt"  # the run drops what it drafted and starts over with the new event


@dataclass(frozen=True)
class Credential:
    name: str  # lower case, as the model names it
    secret: SecretStr
    hosts: tuple[str, ...]  # empty: every allow-listed host
    header: str = "Authorization"

    def header_value(self) -> str:
        raw = self.secret.get_secret_value()
        return f"Bearer {raw}" if self.header.lower() == "authorization" else raw


E = TypeVar("E", Permission, EventPolicy)


def _enum_map(value: str, variable: str, enum: type[E], key: re.Pattern[str], what: str) -> dict[str, E]:
    """``name=value[,name=value...]`` with names matching ``key`` and values of ``enum``."""
    found: dict[str, E] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, raw = (x.strip() for x in item.partition("="))
        if not sep or not name or not raw:
            raise ValueError(f"{variable}: expected name=value[,name=value...], got {item!r}")
        if not key.match(name):
            raise ValueError(f"{name!r} is not {what}")
        try:
            found[name] = enum(raw.lower())
        except ValueError:
            raise ValueError(f"{name}={raw}: expected {', '.join(m.value for m in enum)}") from None
    return found


def parse_permissions(value: str) -> dict[str, Permission]:
    return _enum_map(value, "VIGIL_TOOL_PERMISSIONS", Permission, _TOOL_NAME, "a tool name")


def parse_event_policies(value: str) -> dict[str, EventPolicy]:
    return _enum_map(value, "VIGIL_EVENT_POLICIES", EventPolicy, _SOURCE, "an event source")


def confined(path: str) -> str:
    """A memory path as ``confine`` normalises it; ValueError (for a validator) if outside."""
    try:
        return confine(path)
    except MemoryRefused as exc:
        raise ValueError(str(exc)) from None


def parse_hosts(value: str) -> tuple[str, ...]:
    hosts = tuple(h.strip().lower() for h in value.split(",") if h.strip())
    for host in hosts:
        if not _HOST.match(host):
            raise ValueError(f"{host!r} is not a host or host:port")
    return hosts


# An MCP server's tool is offered as <server>__<tool>; a server's name has no "__" of its own.
MCP_SEPARATOR = "__"


@dataclass(frozen=True)
class McpServer:
    """One entry of ``VIGIL_MCP_SERVERS``: streamable HTTP (``url``) or stdio (``command``)."""

    name: str
    url: str | None = None
    credential: str | None = None  # a VIGIL_CREDENTIAL_<NAME>, sent like http_request sends it
    command: str | None = None
    args: tuple[str, ...] = ()
    # Set over the few variables the SDK passes on (HOME, PATH, ...): never the worker's own.
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None  # the process's working directory (default: the worker's)


def parse_mcp_servers(value: str) -> dict[str, McpServer]:
    """``{"docs": {"url": "https://...", "credential": "docs"}, "files": {"command": "x", "args": []}}``."""
    if not value.strip():
        return {}
    try:
        raw = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object: server name -> {url, credential} or {command, args}")
    servers = {}
    for name, spec in raw.items():
        if not isinstance(name, str) or not _SERVER_NAME.match(name) or len(name) > 30:
            raise ValueError(f"{name!r} is not a server name (lower case letters, digits, single '_')")
        if not isinstance(spec, dict) or ("url" in spec) == ("command" in spec):
            raise ValueError(f"{name}: give either url (streamable HTTP) or command (stdio)")
        unknown = set(spec) - ({"url", "credential"} if "url" in spec else {"command", "args", "env", "cwd"})
        if unknown:
            raise ValueError(f"{name}: unknown keys {', '.join(sorted(unknown))}")
        if "url" in spec:
            url, credential = spec["url"], spec.get("credential")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"{name}: url must be an http(s) URL")
            named = isinstance(credential, str) and _CREDENTIAL_NAME.match(credential.upper())
            if credential is not None and not named:
                raise ValueError(f"{name}: credential must name a VIGIL_CREDENTIAL_<NAME>")
            servers[name] = McpServer(name, url=url, credential=credential.lower() if credential else None)
        else:
            command, args = spec["command"], spec.get("args", [])
            env, cwd = spec.get("env", {}), spec.get("cwd")
            if not isinstance(command, str) or not command:
                raise ValueError(f"{name}: command must be a non-empty string")
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise ValueError(f"{name}: args must be a list of strings")
            if not isinstance(env, dict) or not all(
                isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str) for k, v in env.items()
            ):
                raise ValueError(f"{name}: env must map variable names to strings")
            if cwd is not None and (not isinstance(cwd, str) or not os.path.isabs(cwd)):
                raise ValueError(f"{name}: cwd must be an absolute path")
            servers[name] = McpServer(name, command=command, args=tuple(args), env=tuple(sorted(env.items())), cwd=cwd)
    return servers


def read_credentials(environ: Mapping[str, str], allowed_hosts: tuple[str, ...]) -> dict[str, Credential]:
    """``VIGIL_CREDENTIAL_<NAME>[_HOSTS|_HEADER]`` -> credentials by lower-case name."""
    names = sorted(
        key[len(CREDENTIAL_PREFIX) :]
        for key in environ
        if key.startswith(CREDENTIAL_PREFIX) and not key.endswith(("_HOSTS", "_HEADER"))
    )
    found = {}
    for name in names:
        variable = CREDENTIAL_PREFIX + name
        if not _CREDENTIAL_NAME.match(name):
            raise ValueError(f"{variable}: a credential name is upper-case letters, digits and _")
        if not environ[variable]:
            raise ValueError(f"{variable}: empty secret")
        try:
            hosts = parse_hosts(environ.get(variable + "_HOSTS", ""))
        except ValueError as exc:
            raise ValueError(f"{variable}_HOSTS: {exc}") from None
        outside = [h for h in hosts if h not in allowed_hosts]
        if outside:
            raise ValueError(f"{variable}_HOSTS: {', '.join(outside)} not in VIGIL_HTTP_ALLOWED_HOSTS")
        header = environ.get(variable + "_HEADER", "Authorization").strip()
        if not re.match(r"^[A-Za-z0-9-]{1,64}$", header):
            raise ValueError(f"{variable}_HEADER: {header!r} is not a header name")
        found[name.lower()] = Credential(name.lower(), SecretStr(environ[variable]), hosts, header)
    return found


class AgentSettings(CommonSettings):
    service_name: ClassVar[str] = "agent"

    # Required here: the agent signs the answer token of every approval question it sends.
    approval_secret: SecretStr = Field(
        description="Key that signs approval answer tokens (ingest verifies, worker signs). "
        "Required by ingest and worker; `make up` generates one. Never logged.",
    )
    model: str = Field(DEFAULT_MODEL, min_length=1, description="Claude model id the agent calls.")
    max_turns: int = Field(DEFAULT_MAX_TURNS, ge=1, le=200, description="Most model calls in one run.")
    max_run_tokens: int = Field(
        DEFAULT_MAX_RUN_TOKENS,
        ge=1000,
        le=10_000_000,
        description="Most billed tokens one run may use (input + output + 1.25 x cache writes + 0.1 x cache "
        "reads); the run stops at the next turn boundary past it.",
    )
    max_output_tokens: int = Field(
        DEFAULT_MAX_OUTPUT_TOKENS, ge=16, le=64_000, description="max_tokens of each model call."
    )
    run_wall_s: float = Field(
        DEFAULT_RUN_WALL_S,
        gt=0,
        le=3600,
        description="Wall time of one run; the agent stops at the next turn boundary past it and saves "
        "its session. Keep below VIGIL_RUN_TIMEOUT_S.",
    )
    model_timeout_s: float = Field(DEFAULT_MODEL_TIMEOUT_S, gt=0, le=600, description="Timeout of one model call.")
    model_max_connections: int = Field(
        DEFAULT_MODEL_MAX_CONNECTIONS,
        ge=1,
        le=100_000,
        description="Connections the worker keeps to the model API, all kept alive; "
        "at least VIGIL_RUN_CONCURRENCY, or runs wait for a free one.",
    )
    model_keepalive_s: float = Field(
        DEFAULT_MODEL_KEEPALIVE_S, gt=0, le=3600, description="How long an idle model API connection is kept open."
    )
    model_retries: int = Field(
        DEFAULT_MODEL_RETRIES,
        ge=0,
        le=10,
        description="Retries of a model call after 429, 529, 5xx or a connection error, inside the run; "
        "then the claim is released for later (not counted as a failed attempt).",
    )
    model_backoff_s: float = Field(
        DEFAULT_MODEL_BACKOFF_S, gt=0, le=60, description="First backoff between model call retries; doubles."
    )
    model_fleet_concurrency: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Most model calls in flight across every worker of the deployment (leased slots in the "
        "ledger, model_slots); 0: no fleet-wide bound, each worker's own VIGIL_MAX_CONCURRENT_RUNS only.",
    )
    model_shared_backoff: bool = Field(
        True,
        description="A 429 or 529 one worker is told pauses every worker's model calls for the same time "
        "(model_backoff in the ledger, read at most once a second per worker).",
    )
    model_backoff_cap_s: float = Field(
        DEFAULT_MODEL_BACKOFF_CAP_S,
        gt=0,
        le=600,
        description="Longest wait between model call retries; a longer Retry-After releases the claim instead.",
    )
    session_max_bytes: int = Field(
        DEFAULT_SESSION_MAX_BYTES,
        ge=1000,
        le=50_000_000,
        description="Session size budget: past it the session is closed and the next run starts fresh from memory.",
    )
    memory_file_max_bytes: int = Field(
        DEFAULT_MEMORY_FILE_MAX_BYTES, ge=256, le=10_000_000, description="Largest memory file the agent may write."
    )
    memory_total_max_bytes: int = Field(
        DEFAULT_MEMORY_TOTAL_MAX_BYTES, ge=1024, le=100_000_000, description="Most memory bytes per user."
    )
    memory_max_files: int = Field(DEFAULT_MEMORY_MAX_FILES, ge=1, le=100_000, description="Most memory files per user.")
    instructions_path: str = Field(
        DEFAULT_INSTRUCTIONS_PATH,
        pattern=r"^/memories/[A-Za-z0-9_./-]+$",
        description="Memory file holding the user's standing instructions, loaded into every run.",
    )
    recent_messages: int = Field(
        DEFAULT_RECENT_MESSAGES,
        ge=0,
        le=200,
        description="Delivered messages shown to the agent so it does not repeat itself.",
    )
    tool_permissions: str = Field(
        "",
        description="Per-tool permission overrides, e.g. `refund=ask,http_request=auto` "
        "(allow | deny | ask | auto). Unlisted tools keep their default.",
    )
    event_policies: str = Field(
        "",
        description="What an event arriving mid-run does, per source, e.g. `chat=fold,pager=interrupt` "
        "(queue | fold | interrupt). Default: queue.",
    )
    approval_deadline_s: int = Field(
        DEFAULT_APPROVAL_DEADLINE_S,
        ge=2,
        le=30 * 86_400,
        description="How long an approval request waits for an answer.",
    )
    approval_on_expiry: OnExpiry = Field(
        OnExpiry.DENY,
        description="What an unanswered approval becomes: deny, escalate (ask again at every deadline until a "
        "person answers or an operator denies: `vigil approvals deny`) or approve.",
    )
    approval_actions_base_url: str = Field(
        "",
        max_length=2048,
        description="Where people reach ingest, e.g. `https://vigil.example.com`: the prefix of the signed "
        "approve / deny URLs an approval question's delivery carries. Empty: the URLs are paths, and the "
        "receiving chat app prefixes its ingest address.",
    )
    max_messages_per_run: int = Field(
        DEFAULT_MAX_MESSAGES_PER_RUN, ge=1, le=100, description="Most send_message calls one run may make."
    )
    max_followups_per_run: int = Field(
        DEFAULT_MAX_FOLLOWUPS_PER_RUN, ge=0, le=100, description="Most follow-up timers one run may set."
    )
    followup_max_delay_s: int = Field(
        DEFAULT_FOLLOWUP_MAX_DELAY_S, ge=60, le=10 * 365 * 86_400, description="Furthest ahead a follow-up may be set."
    )
    http_allowed_hosts: str = Field(
        "",
        description="Hosts `http_request` may call, comma separated (`host` any port, `host:port` that port). "
        "Empty: the tool is not offered.",
    )
    http_timeout_s: float = Field(DEFAULT_HTTP_TIMEOUT_S, gt=0, le=300, description="Timeout of one http_request call.")
    http_max_response_bytes: int = Field(
        DEFAULT_HTTP_MAX_RESPONSE_BYTES,
        ge=256,
        le=10_000_000,
        description="Most response bytes http_request hands back to the model (the rest is cut).",
    )
    user_daily_tokens: int = Field(
        0,
        ge=0,
        le=10_000_000_000,
        description="Billed tokens one user's runs may use per UTC day (input + output, cache writes 1.25x, "
        "cache reads 0.1x), unless their profile sets its own; a run past it waits for the next day. 0: no limit.",
    )
    budget_notice: bool = Field(
        True,
        description="Tell a user once a day, through the outbox, that their daily token budget is spent.",
    )
    profile_cache_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="How long a worker keeps the profile assignments it read (`vigil profiles assign`); "
        "a change reaches new runs within this time. 0: read for every run.",
    )
    refund_auto_limit: float = Field(
        DEFAULT_REFUND_AUTO_LIMIT,
        ge=0,
        description="With `refund=auto`: larger refunds are blocked by the policy check "
        "(the example tool package examples/vigil-refund-tool).",
    )
    mcp_servers: str = Field(
        "",
        description='MCP servers whose tools the agent is offered as `<server>__<tool>`, JSON: `{"docs": {"url": '
        '"https://mcp.example.com/mcp", "credential": "docs"}, "files": {"command": "mcp-files", "args": [], '
        '"env": {}, "cwd": "/srv"}}` '
        "(streamable HTTP with a VIGIL_CREDENTIAL_<NAME>, or stdio: a process each worker starts and keeps).",
    )
    mcp_timeout_s: float = Field(
        DEFAULT_MCP_TIMEOUT_S, gt=0, le=600, description="Timeout of one MCP tool call or tool listing."
    )
    mcp_retry_s: float = Field(
        DEFAULT_MCP_RETRY_S,
        gt=0,
        le=3600,
        description="How often a worker lists again an MCP server it could not list (down at start-up); "
        "the server's tools are offered, with their VIGIL_TOOL_PERMISSIONS, from the first listing that succeeds.",
    )
    mcp_max_result_bytes: int = Field(
        DEFAULT_MCP_MAX_RESULT_BYTES,
        ge=256,
        le=10_000_000,
        description="Most bytes of an MCP tool's result handed back to the model (the rest is cut).",
    )
    auto_classifier_model: str = Field(
        "",
        description="A small fast model (e.g. claude-haiku-4-5) asked about every call auto mode's per-tool "
        "rule would run; it can block the call, never allow one the rule blocks. Empty: off.",
    )
    auto_classifier_timeout_s: float = Field(
        DEFAULT_AUTO_CLASSIFIER_TIMEOUT_S,
        gt=0,
        le=60,
        description="Longest wait for the auto-mode classifier; past it the call asks the person instead.",
    )
    auto_classifier_max_tokens: int = Field(
        DEFAULT_AUTO_CLASSIFIER_MAX_TOKENS,
        ge=16,
        le=1024,
        description="Output token cap of one auto-mode classifier call.",
    )

    _credentials: dict[str, Credential] = PrivateAttr(default_factory=dict)

    @field_validator("tool_permissions")
    @classmethod
    def _permissions_parse(cls, value: str) -> str:
        parse_permissions(value)
        return value

    @field_validator("event_policies")
    @classmethod
    def _policies_parse(cls, value: str) -> str:
        parse_event_policies(value)
        return value

    @field_validator("instructions_path")
    @classmethod
    def _instructions_confined(cls, value: str) -> str:
        return confined(value)

    @field_validator("mcp_servers")
    @classmethod
    def _servers_parse(cls, value: str) -> str:
        parse_mcp_servers(value)
        return value

    @field_validator("http_allowed_hosts")
    @classmethod
    def _hosts_parse(cls, value: str) -> str:
        parse_hosts(value)
        return value

    @model_validator(mode="after")
    def _credentials_and_order(self) -> AgentSettings:
        if self.model_backoff_cap_s < self.model_backoff_s:
            raise ValueError("VIGIL_MODEL_BACKOFF_CAP_S must be at least VIGIL_MODEL_BACKOFF_S")
        self._credentials = read_credentials(os.environ, self.allowed_hosts)
        for server in self.servers.values():
            if server.credential and server.credential not in self._credentials:
                raise ValueError(
                    f"VIGIL_MCP_SERVERS: {server.name} names credential {server.credential!r}, "
                    f"but VIGIL_CREDENTIAL_{server.credential.upper()} is not set"
                )
        return self

    @property
    def permissions(self) -> dict[str, Permission]:
        return parse_permissions(self.tool_permissions)

    @property
    def policies(self) -> dict[str, EventPolicy]:
        return parse_event_policies(self.event_policies)

    @property
    def servers(self) -> dict[str, McpServer]:
        return parse_mcp_servers(self.mcp_servers)

    @property
    def allowed_hosts(self) -> tuple[str, ...]:
        return parse_hosts(self.http_allowed_hosts)

    @property
    def credentials(self) -> dict[str, Credential]:
        return dict(self._credentials)
