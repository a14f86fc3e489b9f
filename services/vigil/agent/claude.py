"""The Claude agent: one run = the claim's conversations with the model, through the SDK.

``ClaudeAgent.run(ctx)``:

1. plans which conversation each event goes to (:mod:`vigil.agent.sessions`);
2. builds the cached prefix once for the run (:mod:`vigil.agent.prompt`);
3. runs each conversation (:mod:`vigil.agent.conversation`) against one shared budget of
   turns, tokens and wall time;
4. returns everything as a :class:`RunResult`: messages, follow-up and expiry timers,
   approval requests, memory writes (the difference from the start), saved sessions,
   token usage, folded event ids, and how it ended: ``deferred`` if a call waits for
   approval, else ``message`` if anything is sent, else ``nothing``.

It writes nothing itself; :class:`RetryLater` when the API stays unavailable, any other
exception for a failed attempt.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import anthropic
import httpx2
import psycopg

from vigil import tracing
from vigil.agent import delegation, dreaming, metrics, model
from vigil.agent.actions import BUILT_IN, ToolRegistry, effective_permissions, list_servers_again, permission_of
from vigil.agent.base import OverBudget, RetryLater, RunContext, RunResult, TaskContext, TaskResult
from vigil.agent.conversation import Conversation, RunState, Toolbox, profile_attributes
from vigil.agent.fleet import FleetGate
from vigil.agent.journal import Journal, task_key
from vigil.agent.memory import Limits, MemoryFiles
from vigil.agent.profiles import DEFAULT, Profile, ProfileBook, ProfileRefused, resolve, tool_set
from vigil.agent.prompt import system_blocks, system_prompt, volatile_context
from vigil.agent.screening import Classifier
from vigil.agent.sessions import plan
from vigil.agent.settings import MCP_SEPARATOR, AgentSettings, EventPolicy, Permission, parse_event_policies
from vigil.agent.tools import ActionTool, builtin_definitions
from vigil.clock import Clock, SystemClock, utc
from vigil.ledger import budgets as ledger_budgets
from vigil.ledger import upgrades as ledger_upgrades
from vigil.ledger.db import AsyncPool
from vigil.ledger.dreams import REVIEW
from vigil.ledger.states import RunOutcome, SessionState
from vigil.settings import SettingsError, load

log = logging.getLogger(__name__)


def _own_version() -> str:
    """vigil's own version, as a run's journal records it ("unknown" when run from a tree
    that was never installed)."""
    try:
        return package_version("vigil")
    except PackageNotFoundError:
        return "unknown"


VIGIL_VERSION = _own_version()

# Sockets the process needs besides its model connections: ledger pool, Kafka, health server.
OTHER_FILES = 256

# The agent stops this long before the worker's own run timeout, so that a run stopped by
# its wall-time budget still returns (and saves its session) instead of being cancelled.
DEADLINE_MARGIN_S = 10.0


def model_client(settings: AgentSettings, **client_options: Any) -> anthropic.AsyncAnthropic:
    """The one SDK client every run shares, on the SDK's aiohttp transport.

    Why aiohttp: the default transport's pool (httpcore) walks every pooled connection on
    each request and each release, so at 1,000 connections most of a worker's CPU went to
    picking a connection; aiohttp's pool finds an idle one per host directly. Every
    connection is kept alive (not the SDK's default of 100), so a run's second call reuses
    its first call's connection instead of opening a new one. The SDK's own retries are off:
    model.create is the one retry policy (see there). ``client_options`` (``base_url``,
    ``api_key``) override what the SDK reads from ``ANTHROPIC_*``.
    """
    n = settings.model_max_connections
    _allow_open_files(n + OTHER_FILES)
    limits = httpx2.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=settings.model_keepalive_s)
    http = anthropic.DefaultAioHttpClient(limits=limits)
    return anthropic.AsyncAnthropic(max_retries=0, http_client=http, **client_options)


def _version_of(source: str, version: str) -> str:
    """A tool's version as journaled: ``<package or mcp:server> <version>``."""
    return f"{source} {version or VIGIL_VERSION}".strip() if source == BUILT_IN else f"{source} {version}".strip()


def _moved(start: dict[str, Any], profile: Profile | None) -> bool:
    """Does a replay run with another profile version than its journal's start recorded (an
    operator's `vigil runs upgrade`)?"""
    recorded = tuple(start["profile"]) if start.get("profile") else None
    return recorded is not None and profile is not None and recorded != (profile.name, profile.version)


def with_profile_prompt(system: list[dict[str, Any]], prompt: str | None) -> list[dict[str, Any]]:
    """A recorded system prompt with its first block's profile part set to ``prompt``."""
    return [{**system[0], "text": system_prompt(prompt)}, *system[1:]]


def _allow_open_files(needed: int) -> None:
    """Raise the soft limit of open files toward the hard one: many systems start services
    at a soft limit of 1,024, below what thousands of model connections need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning(
            "open files limited to %d; %d model connections (VIGIL_MODEL_MAX_CONNECTIONS) need about %d",
            target,
            needed - OTHER_FILES,
            needed,
        )


class ClaudeAgent:
    needs_context = True  # the worker loads sessions, memory, past messages and approvals

    @property
    def recent_messages(self) -> int:
        """How many past messages the worker loads for a run (VIGIL_RECENT_MESSAGES)."""
        return self.settings.recent_messages

    def __init__(
        self,
        settings: AgentSettings,
        client: anthropic.AsyncAnthropic | None = None,
        actions: list[ActionTool] | None = None,
    ):
        self.settings = settings
        # MCP servers that could not be listed at start-up, and why: list_servers_again's.
        self.servers_down: dict[str, str] = {}
        # Each action tool's version as a run's journal records it: its package's, or its MCP
        # server's name and version ("vigil" and vigil's version for those compiled in).
        self.tool_versions: dict[str, str] = {}
        if actions is None:
            registry = ToolRegistry.from_settings(settings)
            actions, self.servers_down = registry.tools, dict(registry.unreachable)
            self.tool_versions = {e.tool.name: _version_of(e.source, e.version) for e in registry.entries}
        permissions = effective_permissions(settings, actions, self.servers_down)
        policies = settings.policies
        if policies.get("approval", EventPolicy.QUEUE) is not EventPolicy.QUEUE:
            raise SettingsError("VIGIL_EVENT_POLICIES: approval events resume their own session and are always queued")
        builtins = builtin_definitions(settings)
        self.definitions = {**builtins, **{t.name: t.definition() for t in actions}}
        client = client or model_client(settings)
        model.prepare()
        self.box = Toolbox(
            settings=settings,
            client=client,
            retry=model.CallPolicy(
                settings.model_retries, settings.model_backoff_s, settings.model_backoff_cap_s, settings.model_timeout_s
            ),
            actions={t.name: t for t in actions},
            permissions=permissions,
            tools=model.Encoded.of(self._offered(permissions)),
            policies=policies,
            classifier=Classifier(
                client,
                settings.auto_classifier_model,
                settings.auto_classifier_timeout_s,
                settings.auto_classifier_max_tokens,
            )
            if settings.auto_classifier_model
            else None,
        )
        self.limits = Limits(settings.memory_file_max_bytes, settings.memory_total_max_bytes, settings.memory_max_files)
        self.profiles: ProfileBook | None = None  # set by join_fleet: profiles live in the ledger
        self.user_ledger: Callable[[str], AsyncPool] | None = None  # set by join_fleet: several ledger shards
        self._boxes: dict[tuple[str, int], Toolbox] = {}
        self.clock: Clock = SystemClock()  # what "today" is for daily budgets
        metrics.BUDGET_TOKENS.labels(DEFAULT).set(settings.user_daily_tokens)  # the series before any run

    def acting_tools(self) -> list[str]:
        """The tools that may act on the world when called: every action tool not marked
        read-only, whatever its permission here (a profile may allow a tool the deployment
        denies), and the tools of each MCP server that was not reachable at start (unknown)."""
        acting = [t.name for t in self.box.actions.values() if not t.read_only]
        return acting + [f"{server}__* (MCP server not listed at start)" for server in sorted(self.servers_down)]

    def down(self) -> dict[str, str]:
        """The MCP servers not listed yet (down since start-up), and why."""
        return dict(self.servers_down)

    @classmethod
    def from_environment(cls) -> ClaudeAgent:
        """The agent as ``VIGIL_*`` and ``ANTHROPIC_*`` configure it; SettingsError names what is wrong."""
        if not os.environ.get("ANTHROPIC_API_KEY") and not os.environ.get("ANTHROPIC_AUTH_TOKEN"):
            raise SettingsError("ANTHROPIC_API_KEY: required with VIGIL_AGENT=claude")
        return cls(load(AgentSettings))

    async def join_fleet(
        self, pool: AsyncPool, instance: str, user_ledger: Callable[[str], AsyncPool] | None = None
    ) -> None:
        """Share the model with the deployment's other workers (:mod:`vigil.agent.fleet`):
        their 429/529 back-off, and ``VIGIL_MODEL_FLEET_CONCURRENCY`` if set; and the agent
        profiles assigned to users (:mod:`vigil.agent.profiles`). ``pool`` is the catalog's;
        a user's spending is read on ``user_ledger(user_id)``, their ledger shard."""
        s = self.settings
        self.profiles = ProfileBook(pool, s.profile_cache_s)
        self.user_ledger = user_ledger
        if not s.model_fleet_concurrency and not s.model_shared_backoff:
            return
        gate = FleetGate(
            pool,
            concurrency=s.model_fleet_concurrency,
            shared_backoff=s.model_shared_backoff,
            instance=instance,
            call_timeout_s=s.model_timeout_s,
        )
        await gate.start()
        self.box.retry = replace(self.box.retry, gate=gate)

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """What the worker runs beside the runs for as long as it lives."""
        return [self.list_servers_again()] if self.servers_down else []

    async def list_servers_again(self) -> None:
        """Every ``VIGIL_MCP_RETRY_S``, list the MCP servers that were down; offer the tools of
        each that answers from then on, with the permissions VIGIL_TOOL_PERMISSIONS gives them.

        Runs that started before keep the tools they started with (their box); the next runs
        get the wider one. The tool list is part of the cached prompt prefix, so the prefix
        changes once per server that comes back."""
        while self.servers_down:
            await asyncio.sleep(self.settings.mcp_retry_s)
            found, still_down = await list_servers_again(self.settings, sorted(self.servers_down))
            back = sorted(set(self.servers_down) - set(still_down))
            self._add_tools([entry.tool for entry in found])
            for server in back:
                offered = [e.tool.name for e in found if e.tool.server == server]
                log.info("MCP server %s is up: %d tool(s) offered from now on", server, len(offered))
                prefix = f"{server}{MCP_SEPARATOR}"
                for name in sorted(n for n in self.settings.permissions if n.startswith(prefix)):
                    if name not in offered:
                        log.warning("VIGIL_TOOL_PERMISSIONS: MCP server %s has no tool named %r", server, name)
            self.servers_down = still_down

    def _add_tools(self, tools: list[ActionTool]) -> None:
        """A new default box with ``tools`` besides the agent's (profiles' boxes are built again)."""
        box = self.box
        actions, permissions = dict(box.actions), dict(box.permissions)
        for tool in tools:
            if tool.name in permissions:  # a built-in or a package's: start-up would have refused it
                log.error("MCP server %s: tool %s skipped, a tool of that name exists", tool.server, tool.name)
                continue
            actions[tool.name] = tool
            permissions[tool.name] = permission_of(self.settings, tool)
            self.definitions[tool.name] = tool.definition()
        self.box = replace(
            box, actions=actions, permissions=permissions, tools=model.Encoded.of(self._offered(permissions))
        )
        self._boxes.clear()

    def _offered(self, permissions: dict[str, Permission]) -> list[dict[str, Any]]:
        """The definitions of the tools ``permissions`` does not deny, in their fixed order."""
        return [
            d for name, d in self.definitions.items() if permissions.get(name, Permission.DENY) is not Permission.DENY
        ]

    async def close(self) -> None:
        await self.box.client.close()
        for tool in self.box.actions.values():
            connection = getattr(tool, "connection", None)  # an MCP tool's server (stdio: its process)
            if connection is not None:
                await connection.close()

    def box_for(self, profile: Profile | None) -> Toolbox:
        """What runs of ``profile`` share (the deployment's own for the default profile): its
        settings over the deployment's, its tool set over the agent's tools, its event policies
        over the deployment's, its MCP servers (when it names any) choosing among the deployment's.
        Built once per profile version (versions never change)."""
        if profile is None:
            return self.box
        box = self._boxes.get((profile.name, profile.version))
        if box is not None:
            return box
        spec = profile.spec
        permissions = self.box.permissions
        if spec.tools is not None:
            missing = sorted(set(spec.tools) - set(permissions))
            if missing:
                log.warning("profile %s v%d: no tool named %s here", profile.name, profile.version, ", ".join(missing))
            permissions = tool_set(permissions, spec.tools)
        if spec.mcp_servers:
            permissions = self._only_servers(profile, permissions)
        policies = dict(self.box.policies)
        if spec.event_policies:
            policies |= parse_event_policies(spec.event_policies)
        box = replace(
            self.box,
            settings=self.settings.model_copy(update=spec.settings_update()),
            permissions=permissions,
            tools=model.Encoded.of(self._offered(permissions)),
            policies=policies,
        )
        self._boxes[profile.name, profile.version] = box
        return box

    def _only_servers(self, profile: Profile, permissions: dict[str, Permission]) -> dict[str, Permission]:
        """``permissions`` without the tools of MCP servers the profile does not name.
        VIGIL_MCP_SERVERS says which servers exist; a profile chooses among them, never adds one."""
        chosen = set(profile.spec.mcp_servers)
        missing = sorted(chosen - set(self.settings.servers))
        if missing:
            log.warning(
                "profile %s v%d: no MCP server named %s in VIGIL_MCP_SERVERS",
                profile.name,
                profile.version,
                ", ".join(missing),
            )
        actions = self.box.actions
        return {
            name: p
            for name, p in permissions.items()
            if name not in actions or actions[name].server is None or actions[name].server in chosen
        }

    def _prefix(
        self, ctx: RunContext, memory: MemoryFiles, now: datetime, box: Toolbox, profile: Profile | None
    ) -> list[dict[str, Any]]:
        path = box.settings.instructions_path
        limit = box.settings.recent_messages
        queued = ctx.queued_messages[-limit:] if limit else []
        recent = ctx.recent_messages[-(limit - len(queued)) :] if limit > len(queued) else []
        volatile = volatile_context(now, recent, queued, ctx.dead_events)
        prompt = profile.spec.system_prompt if profile else None
        return system_blocks(path, memory.files.get(path), memory.index(path), volatile, prompt)

    def policies_for(self, ctx: RunContext, box: Toolbox | None = None) -> dict[str, EventPolicy]:
        """The profile's event policies with the user's own (``agent_policies``) over them.
        An override the ledger holds but that no longer parses is ignored, loudly: a user's
        row must not fail every run of theirs."""
        policies = dict((box or self.box).policies)
        if not ctx.event_policies:
            return policies
        try:
            own = parse_event_policies(ctx.event_policies)
        except ValueError as exc:
            log.warning("ignoring the user's event policies (agent_policies): %s", exc)
            return policies
        own.pop("approval", None)  # approval answers resume their own session: always queued
        return policies | own

    async def run_task(self, ctx: TaskContext) -> TaskResult:
        """Execute a background task: a child conversation with the task's tools, under the
        profile version its delegating run had (model, limits, tool set; the deployment's for
        the default), re-checked against this worker's permissions (a tool since set to ask or
        deny is dropped)."""
        profile = await self._task_profile(ctx)
        box = self.box_for(profile)
        settings = box.settings
        child = delegation.Child(
            client=box.client,
            settings=settings,
            retry=box.retry,
            actions=box.actions,
            permissions=box.permissions,
            user_id=ctx.user_id,
            key=ctx.task_id,
            tools=ctx.tools,
            delegation=ctx.delegation,
            budget=model.Budget(
                settings.max_turns, ctx.token_budget, ctx.deadline, profile=profile.name if profile else DEFAULT
            ),
            usage=ctx.usage,
            journal=ctx.journal or Journal(task_key(ctx.task_id, ctx.lease_epoch, journaled=False)),
            tasks=ctx.tasks,
            session_id=ctx.session_id,
            spawned=ctx.spawned,
        )
        if ctx.kind == REVIEW:
            return await dreaming.review(ctx, child, settings, self.limits)
        return TaskResult(await delegation.run_child(child, ctx.instructions))

    async def _recorded_profile(self, ctx: RunContext, start: dict | None) -> Profile | None:
        """A replayed run's profile: the version its journal's start recorded, not the user's
        current one (docs/worker.md, "Versions that hold"), unless an operator moved the run to
        a newer one (`vigil runs upgrade`): then that. None: a fresh run, or none recorded."""
        recorded = start.get("profile") if start else None
        if not recorded or self.profiles is None:
            return None
        name, version = recorded
        moved = await self._upgraded_to(ctx, name)
        if moved is not None and moved > version:
            log.info(
                "replaying %s under %s v%d, moved there from v%d by an operator", ctx.run_key, name, moved, version
            )
            version = moved
        profile = await self.profiles.version(name, version)
        if profile is None:
            raise ProfileRefused(f"profile {name} v{version}: the replayed run's version is not in the ledger")
        return profile

    def _ledger_of(self, user_id: str) -> AsyncPool:
        """The ledger (shard) that holds ``user_id``'s rows: their runs, upgrades, notices."""
        assert self.profiles is not None
        return self.profiles.pool if self.user_ledger is None else self.user_ledger(user_id)

    async def _upgraded_to(self, ctx: RunContext, profile: str) -> int | None:
        """The version an operator moved this in-flight run to, if any (one indexed read, on a
        replay only). The ledger unreadable is RetryLater: the run must not go on under a
        version the operator moved it away from."""
        assert self.profiles is not None
        ledger = self._ledger_of(ctx.user_id)
        try:
            async with ledger.connection() as conn:
                return await ledger_upgrades.latest(conn, run_key=ctx.run_key, profile=profile)
        except psycopg.Error as exc:
            raise RetryLater(f"upgrade lookup: {exc}") from exc

    async def _task_profile(self, ctx: TaskContext) -> Profile | None:
        """The task's profile version. Not found, or the ledger unreadable: the task fails with
        the reason rather than run with the deployment's settings, which may be wider."""
        if ctx.profile is None:
            return None
        name, version = ctx.profile
        if self.profiles is None:
            raise ProfileRefused(f"profile {name} v{version}: this agent reads no profiles")
        try:
            profile = await self.profiles.version(name, version)
        except psycopg.Error as exc:
            raise ProfileRefused(f"profile {name} v{version}: the ledger did not answer: {exc}") from exc
        if profile is None:
            raise ProfileRefused(f"profile {name} v{version}: no such version in the ledger")
        return profile

    def _daily(self, profile: Profile | None) -> int:
        """The daily budget of ``profile``'s users (0: none): its own, else the deployment's;
        exported as ``vigil_budget_tokens{profile}`` for the dashboard's spend against it."""
        daily = self.settings.user_daily_tokens
        if profile is not None and profile.spec.daily_tokens is not None:
            daily = profile.spec.daily_tokens
        metrics.BUDGET_TOKENS.labels(profile.name if profile else DEFAULT).set(daily)
        return daily

    async def _left_today(self, user_id: str) -> int | None:
        """Billed tokens the user may still use today under the daily budget of their current
        profile (not a resumed session's pinned version; None: no budget). Spent: read again
        from the ledger, uncached (an operator may just have raised it). A remainder too small
        for one model call (``model.MIN_CALL_TOKENS``) counts as spent: :class:`OverBudget`
        until the next UTC day, and the user told once. (Started with it, the run could make
        no call and would end with nothing: its events done, unprocessed.)"""
        book = self.profiles
        if book is None:
            return None
        now = utc(self.clock.now())
        today = datetime(now.year, now.month, now.day, tzinfo=UTC)
        try:
            profile = await book.current(user_id)
            if not (daily := self._daily(profile)):
                return None
            ledger = self._ledger_of(user_id)
            async with ledger.connection() as conn:
                spent = await ledger_budgets.spent(conn, user_id=user_id, since=today)
            if daily - spent < model.MIN_CALL_TOKENS:
                profile = await book.current(user_id, fresh=True)
                if not (daily := self._daily(profile)):
                    return None
            if daily - spent >= model.MIN_CALL_TOKENS:
                return daily - spent
        except psycopg.Error as exc:
            raise RetryLater(f"budget lookup: {exc}") from exc
        await self._refuse(user_id, profile, daily, spent)
        return None  # not reached: _refuse raises

    async def _refuse(self, user_id: str, profile: Profile | None, daily: int, spent: int) -> None:
        """The user's daily budget is spent: counted, the user told once a day (an outbox
        row), and :class:`OverBudget`, so the run's events wait for the next UTC day with no
        attempt counted."""
        now = utc(self.clock.now())
        today = datetime(now.year, now.month, now.day, tzinfo=UTC)
        tomorrow = today + timedelta(days=1)
        name = profile.name if profile else DEFAULT
        metrics.BUDGET_EXHAUSTED.labels(name).inc()
        if self.settings.budget_notice and self.profiles is not None:
            ledger = self._ledger_of(user_id)
            body = (
                f"Your daily model budget ({daily} tokens) is spent; what arrives for you waits "
                f"until {tomorrow.isoformat(timespec='minutes')}."
            )
            try:
                async with ledger.connection() as conn:
                    await ledger_budgets.notify_once(conn, user_id=user_id, day=today.date(), profile=name, body=body)
            except psycopg.Error as exc:
                raise RetryLater(f"budget notice: {exc}") from exc
        wait = (tomorrow - now).total_seconds()
        left = max(daily - spent, 0)
        raise OverBudget(
            f"daily token budget spent ({spent} of {daily}; {left} left, fewer than a model call takes)",
            retry_after=wait,
        )

    @staticmethod
    def _recorded_model(box: Toolbox, start: dict[str, Any]) -> Toolbox:
        """A replay asks the model its start recorded (a default-profile run whose deployment
        changed VIGIL_MODEL since), not the current one."""
        model_id = start.get("model")
        if not model_id or model_id == box.settings.model:
            return box
        return replace(box, settings=box.settings.model_copy(update={"model": model_id}))

    async def _run_profile(self, ctx: RunContext, start: dict | None) -> Profile | None:
        """The profile version the run runs with: a replay's recorded one, else the user's."""
        profile = await self._recorded_profile(ctx, start)
        if profile is None:
            profile = await resolve(self.profiles, ctx.user_id, ctx.session.id if ctx.session else None)
        return profile

    def _tool_set(self, box: Toolbox) -> dict[str, str]:
        """The tools ``box`` offers, each with its version (builtins: vigil's)."""
        return {
            name: self.tool_versions.get(name, _version_of(BUILT_IN, ""))
            for name, p in box.permissions.items()
            if p is not Permission.DENY
        }

    async def _count_version_change(
        self, ctx: RunContext, start: dict[str, Any], box: Toolbox, profile: Profile | None
    ) -> None:
        """A replay: count what its journal's start recorded that this worker would now start
        it with otherwise (``vigil_runs_replayed_across_versions_total``), and a run an
        operator moved to another version (``vigil_runs_upgraded_total``)."""
        recorded = tuple(start["profile"]) if start.get("profile") else None
        if _moved(start, profile):
            assert profile is not None
            metrics.RUNS_UPGRADED.labels(profile.name).inc()
        try:
            now = await resolve(self.profiles, ctx.user_id, ctx.session.id if ctx.session else None)
        except RetryLater:
            now = None  # unknown: not counted as a change
        else:
            if recorded != ((now.name, now.version) if now else None):
                metrics.REPLAYED_ACROSS.labels("profile").inc()
        if "model" in start and start["model"] != self.box_for(now).settings.model:
            metrics.REPLAYED_ACROSS.labels("model").inc()
        tools = start.get("tools")
        if tools is not None and any(self._tool_set(box).get(name) != v for name, v in tools.items()):
            metrics.REPLAYED_ACROSS.labels("tools").inc()
        if "vigil" in start and start["vigil"] != VIGIL_VERSION:
            metrics.REPLAYED_ACROSS.labels("vigil").inc()

    def _opening(
        self, ctx: RunContext, start: dict | None, memory: MemoryFiles, box: Toolbox, profile: Profile | None
    ) -> tuple[datetime, list[dict[str, Any]]]:
        """The run's "now" and system prompt."""
        if start is not None:
            # A replay: the prompt's "now" and the system prompt as the model saw them, so the
            # transcript it sees next is the same bytes (and the cached prefix still matches);
            # a run moved to another version gets that version's part of the prompt.
            system = start["system"]
            if _moved(start, profile):
                system = with_profile_prompt(system, profile.spec.system_prompt if profile else None)
            return datetime.fromisoformat(start["now"]), system
        now = datetime.now(UTC)
        return now, self._prefix(ctx, memory, now, box, profile)

    async def run(self, ctx: RunContext) -> RunResult:
        journal = ctx.journal or Journal(ctx.run_key)
        start = journal.start
        profile = await self._run_profile(ctx, start)
        tracing.set_current(profile_attributes((profile.name, profile.version) if profile else None))  # on vigil.run
        box = self.box_for(profile)
        if start is not None:
            # The recorded model, unless an operator moved the run to a version of its own.
            box = box if _moved(start, profile) else self._recorded_model(box, start)
            await self._count_version_change(ctx, start, box, profile)
        settings = box.settings
        max_tokens = settings.max_run_tokens
        left = await self._left_today(ctx.user_id)
        if left is not None:
            max_tokens = min(max_tokens, left)  # a run ends at the day's bound, its session saved
        deadline = min(ctx.deadline - DEADLINE_MARGIN_S, time.monotonic() + settings.run_wall_s)
        memory = MemoryFiles(ctx.memory, self.limits)
        now, system = self._opening(ctx, start, memory, box, profile)
        run = RunState(
            ctx=ctx,
            memory=memory,
            budget=model.Budget(settings.max_turns, max_tokens, deadline, profile=profile.name if profile else DEFAULT),
            now=now,
            system=model.Encoded.of(system),
            approvals=dict(ctx.approval_requests),
            journal=journal,
            start={
                "events": [e.id for e in ctx.events],
                "now": now.isoformat(),
                "system": system,
                "profile": [profile.name, profile.version] if profile else None,
                "model": settings.model,
                "tools": self._tool_set(box),
                "vigil": VIGIL_VERSION,
            },
            policies=self.policies_for(ctx, box),
        )
        laid_out = plan(ctx, settings.session_max_bytes)
        result = RunResult(profile=(profile.name, profile.version) if profile else None)
        saves = []
        for thread in laid_out.threads:
            ended = await Conversation(box, run, thread).converse()
            # Each message names its conversation, so that a reply to its delivery resumes it.
            sid = thread.session_id
            result.messages += [replace(m, session_id=m.session_id or sid) for m in ended.outputs.messages]
            result.timers += ended.outputs.timers
            result.tasks += ended.outputs.tasks
            result.approvals += ended.approvals
            if ended.touched:
                saves.append(thread.save(settings.session_max_bytes))
        saves += laid_out.closed
        metrics.SESSIONS_CLOSED.inc(sum(s.state == SessionState.CLOSED for s in saves))
        if saves:
            result.session, result.other_sessions = saves[0], saves[1:]
        result.memory_writes = memory.writes()
        result.usage = run.budget.usage()
        result.folded_event_ids = [e.id for e in run.folded]
        if result.approvals:
            result.outcome = RunOutcome.DEFERRED
        elif result.messages:
            result.outcome = RunOutcome.MESSAGE
        else:
            result.outcome = RunOutcome.NOTHING
        return result
