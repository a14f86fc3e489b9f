"""The registry of action tools: where each tool of a deployment comes from.

Three sources, in the order the model is shown them:

1. built into vigil: ``http_request`` (offered when ``VIGIL_HTTP_ALLOWED_HOSTS`` is set);
2. tool packages: ordinary Python packages that declare an entry point in the
   ``vigil.tools`` group, named after the tool, whose object is a factory
   ``(AgentSettings) -> ActionTool`` (examples/vigil-refund-tool is one);
3. MCP servers named in ``VIGIL_MCP_SERVERS`` (:mod:`vigil.agent.mcp_tools`), their tools
   offered as ``<server>__<tool>``.

A :class:`ToolRegistry` is built from settings, not kept in module globals, so that a caller
with other settings (a test, a later per-user profile) builds its own. Two tools with one
name stop start-up with one line naming both sources: which one the model would get must
never depend on the order packages happen to be installed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from vigil.agent.http_tool import HttpRequestTool
from vigil.agent.settings import MCP_SEPARATOR, AgentSettings, Permission
from vigil.agent.tools import BUILTIN, ActionTool
from vigil.outbound import address_policy
from vigil.settings import SettingsError

ENTRY_POINT_GROUP = "vigil.tools"
BUILT_IN = "vigil"  # the source of the tools compiled into vigil


@dataclass(frozen=True)
class Registered:
    """One action tool and where it came from (``vigil tools list`` shows both)."""

    tool: ActionTool
    source: str  # "vigil", a distribution name, or "mcp:<server>"
    version: str  # the distribution's version; an MCP server's as it reports it

    def describe(self) -> str:
        return f"{self.source} {self.version}".strip()


class ToolRegistry:
    """The action tools of one agent, unique by name. Raises SettingsError on a clash."""

    def __init__(self, entries: Iterable[Registered], unreachable: dict[str, str] | None = None):
        # MCP servers that could not be listed, and why: they offer no tools until they can be.
        self.unreachable = dict(unreachable or {})
        self.entries: list[Registered] = []
        seen: dict[str, Registered] = {}
        for entry in entries:
            name = entry.tool.name
            if name in BUILTIN:
                raise SettingsError(f"tool {name!r} from {entry.describe()} has the name of a built-in tool")
            if name in seen:
                raise SettingsError(
                    f"two tools are named {name!r}: from {seen[name].describe()} and from {entry.describe()}; "
                    "uninstall or rename one"
                )
            seen[name] = entry
            self.entries.append(entry)

    @classmethod
    def from_settings(cls, settings: AgentSettings) -> ToolRegistry:
        """Built in, then installed packages, then MCP servers (whose tools are listed now)."""
        listed: list = []
        unreachable: dict[str, str] = {}
        if settings.servers:
            # Imported only when servers are named: the MCP SDK costs a worker's start most of a
            # second (a second worker joining a group late misses the rebalance it was for).
            from vigil.agent.mcp_tools import server_tools

            listed, unreachable = server_tools(settings)
        served = [Registered(tool, f"mcp:{tool.server}", version) for tool, version in listed]
        return cls([*builtin_tools(settings), *package_tools(settings), *served], unreachable)

    @property
    def tools(self) -> list[ActionTool]:
        return [entry.tool for entry in self.entries]

    def listing(self, permissions: dict[str, Permission]) -> list[dict[str, str]]:
        """What ``vigil tools list`` prints: every tool, built-ins first, with its permission."""
        rows = [{"name": name, "source": BUILT_IN, "version": "", "permission": permissions[name]} for name in BUILTIN]
        rows += [
            {
                "name": e.tool.name,
                "source": e.source,
                "version": e.version,
                "permission": permissions[e.tool.name].value,
            }
            for e in self.entries
        ]
        return [{k: str(v) for k, v in row.items()} for row in rows]


def builtin_tools(settings: AgentSettings) -> list[Registered]:
    if not settings.allowed_hosts:
        return []
    tool = HttpRequestTool(
        settings.allowed_hosts,
        settings.credentials,
        settings.http_timeout_s,
        settings.http_max_response_bytes,
        address_policy(settings),
    )
    return [Registered(tool, BUILT_IN, "")]


def _installed() -> list[EntryPoint]:
    """The group's entry points, each once: a distribution found twice on the path (an
    editable install beside a copy) declares the same entry point twice, which is no clash."""
    unique: dict[tuple[str, str, str], EntryPoint] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        dist = point.dist.name if point.dist is not None else "?"
        unique.setdefault((point.name, point.value, dist), point)
    return sorted(unique.values(), key=lambda p: (p.name, p.dist.name if p.dist else ""))


def known_names() -> set[str]:
    """The names of the tools compiled in and installed (MCP servers' tools are not listed)."""
    return {*BUILTIN, HttpRequestTool.name, *(point.name for point in _installed())}


def package_tools(settings: AgentSettings) -> list[Registered]:
    """The tools of every installed package declaring a ``vigil.tools`` entry point.

    A package that fails to load, or whose factory returns something else than an action
    tool named like its entry point, stops start-up: a tool silently missing would leave
    the model without it and nobody told.
    """
    found = []
    for point in _installed():
        dist = point.dist
        source, version = (dist.name, dist.version) if dist is not None else (point.value, "")
        where = f"entry point {point.name} = {point.value} ({source} {version})"
        try:
            factory = point.load()
            tool = factory(settings)
        except Exception as exc:
            raise SettingsError(f"{where} failed to load: {type(exc).__name__}: {exc}") from None
        if not isinstance(tool, ActionTool):
            raise SettingsError(f"{where} returned {type(tool).__name__}, not an ActionTool")
        if tool.name != point.name:
            raise SettingsError(f"{where} returned a tool named {tool.name!r}; name the entry point after it")
        found.append(Registered(tool, source, version))
    return found


def effective_permissions(
    settings: AgentSettings, actions: list[ActionTool], servers_down: Iterable[str] = ()
) -> dict[str, Permission]:
    """Every tool's permission: defaults, then VIGIL_TOOL_PERMISSIONS. Raises SettingsError.

    A permission naming a tool of an MCP server in ``servers_down`` (configured, not listed
    yet) is no error: that server's tools are unknown until it answers, and the permission
    waits in the settings for them (:func:`permission_of`). Any other name no tool has is
    refused: a typo must stop start-up, not leave a tool with its default permission."""
    permissions = {name: Permission.ALLOW for name in BUILTIN}
    permissions.update({tool.name: tool.default_permission for tool in actions})
    waiting = tuple(f"{server}{MCP_SEPARATOR}" for server in servers_down)
    for name, permission in settings.permissions.items():
        if name not in permissions:
            if waiting and name.startswith(waiting):
                continue
            raise SettingsError(f"VIGIL_TOOL_PERMISSIONS: no tool named {name!r} (tools: {', '.join(permissions)})")
        if name in BUILTIN and permission not in (Permission.ALLOW, Permission.DENY):
            raise SettingsError(f"VIGIL_TOOL_PERMISSIONS: {name} is built in and can only be allow or deny")
        permissions[name] = permission
    return permissions


def permission_of(settings: AgentSettings, tool: ActionTool) -> Permission:
    """The permission of a tool that arrived after start-up (an MCP server that came back)."""
    return settings.permissions.get(tool.name, tool.default_permission)


async def list_servers_again(settings: AgentSettings, names: list[str]) -> tuple[list[Registered], dict[str, str]]:
    """The tools of the MCP servers ``names`` (down so far), listed now on the caller's loop;
    and why each of them that still cannot be listed offers none."""
    # Imported here as in from_settings: servers are named, so the SDK is loaded already.
    from vigil.agent.mcp_tools import list_again

    listed, down = await list_again(settings, names)
    return [Registered(tool, f"mcp:{tool.server}", version) for tool, version in listed], down


def action_tools(settings: AgentSettings) -> list[ActionTool]:
    """Every action tool of this deployment, in the order the model is shown them."""
    return ToolRegistry.from_settings(settings).tools
