"""`vigil approvals list|deny`: operators see the questions waiting for people and decide.
`vigil policies show|set`: one user's overrides of the deployment's agent settings.
`vigil tools list`: the tools a worker with these settings offers, where each comes from.

An approval whose policy is ``escalate`` fails closed: it is asked again at every deadline
and never runs the tool on silence, so a request nobody will answer (a person gone on
leave, a question sent to the wrong channel) waits until an operator denies it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from datetime import UTC, datetime

import click
from pydantic import Field, SecretStr

from vigil.admin.connection import cli_connection
from vigil.admin.shards import Shards, echo_rows, report_down, with_shard
from vigil.agent.profiles import ProfileSpec, parse_spec, tool_set
from vigil.agent.settings import AgentSettings, parse_event_policies
from vigil.cliutil import UserId, WholeNumber
from vigil.ledger import agent as ledger_agent
from vigil.ledger import approvals as rule
from vigil.ledger import profiles as ledger_profiles
from vigil.ledger.db import connect
from vigil.ledger.shardmap import ShardUnreachable
from vigil.service import StartupError, load_or_exit
from vigil.settings import CommonSettings, SettingsError


def _ledger():
    return cli_connection()


@click.group("approvals")
def approvals() -> None:
    """List approval requests and deny those nobody will answer."""


@approvals.command("list")
@click.option("--user", "user_id", help="Only this user's requests.")
@click.option("--all", "include_answered", is_flag=True, help="Include answered and expired requests.")
@click.option("--limit", type=WholeNumber(1, 10_000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def approvals_list(user_id, include_answered, limit, as_json) -> None:
    """Open approval requests (newest first): who, which tool, the deadline, times asked again.

    Every shard's (one user's: that user's shard), merged newest first."""
    shards = Shards(load_or_exit(CommonSettings))

    def read(dsn: str) -> list[rule.RequestRow]:
        with connect(dsn, autocommit=True) as conn:
            return rule.list_requests(conn, user_id, include_answered, limit)

    if user_id:
        found = [(shards.of_user(user_id), row) for row in shards.on_user(user_id, read)]
        down: list[ShardUnreachable] = []
    else:
        merged, down = shards.merged(read, lambda r: r.created_at, limit)
        found = [(f.shard, f.value) for f in merged]
    for shard, row in found:
        if as_json:
            echo_rows([with_shard(asdict(row), shard, shards)])
        else:
            state = row.answer or f"open, due {row.due.isoformat()}"
            where = f"shard {shard}  " if shards.many else ""
            click.echo(
                f"{where}{row.request_id}  {row.user_id}  {row.tool}  {row.on_expiry}  "
                f"asked again {row.escalations}x  {state}"
            )
    report_down(down)


@approvals.command("deny")
@click.argument("request_id")
def approvals_deny(request_id) -> None:
    """Deny an open request: the session resumes with the denial (at the scheduler's next pass).

    On the shard that holds the request (request ids are unique: the first shard that knows it)."""

    def deny(dsn: str) -> tuple[bool, rule.Standing] | None:
        with connect(dsn, autocommit=True) as conn, conn.transaction():
            denied, standing = rule.operator_deny(conn, request_id, datetime.now(UTC))
        return None if standing.answer == rule.UNKNOWN else (denied, standing)

    found = Shards(load_or_exit(CommonSettings)).locate(deny, f"approval request {request_id}", unique=True)
    denied, standing = found.value if found else (False, rule.Standing(request_id, rule.UNKNOWN))
    if standing.answer == rule.UNKNOWN:
        raise click.ClickException(f"no approval request {request_id!r}")
    if not denied:
        raise click.ClickException(f"{request_id} was already decided: {standing.answer}")
    click.echo(f"{request_id}: denied; the session of {standing.user_id} resumes with the denial")


@click.group("policies")
def policies() -> None:
    """Per-user agent settings: what an event arriving mid-run does, per source."""


def _show(user_id: str, event_policies: str) -> str:
    return f"{user_id}: event policies {event_policies or '(the deployment default)'}"


@policies.command("show")
@click.argument("user_id")
def policies_show(user_id) -> None:
    """The user's overrides (VIGIL_EVENT_POLICIES applies to every source they do not name)."""
    with _ledger() as conn:
        row = ledger_agent.get_policies(conn, user_id)
    click.echo(_show(user_id, row.event_policies if row else ""))


@policies.command("set")
@click.argument("user_id", type=UserId())
@click.argument("event_policies")
def policies_set(user_id, event_policies) -> None:
    """Replace the user's event policies, e.g. 'chat=fold,pager=interrupt' ('' clears them).

    Each source named wins over VIGIL_EVENT_POLICIES for this user: queue (the next run),
    fold (joins the running run at its next model turn), interrupt (the run starts over with it).
    """
    try:
        parsed = parse_event_policies(event_policies)
    except ValueError as exc:
        raise click.UsageError(f"EVENT_POLICIES: {exc}") from None
    if "approval" in parsed:
        raise click.UsageError("EVENT_POLICIES: approval events resume their own session and are always queued")
    canonical = ",".join(f"{source}={policy.value}" for source, policy in sorted(parsed.items()))
    with _ledger() as conn:
        row = ledger_agent.set_policies(conn, user_id=user_id, event_policies=canonical)
    click.echo(_show(row.user_id, row.event_policies))


@click.group("tools")
def tools() -> None:
    """The agent's tools: built in, from tool packages, from MCP servers."""


class ListingSettings(AgentSettings):
    """The agent's settings as `vigil tools list` reads them: it signs no approval, so it runs
    where the worker's secrets are not (a laptop, a CI job checking VIGIL_MCP_SERVERS)."""

    approval_secret: SecretStr = Field(SecretStr(""), description="Not read by `vigil tools list`.")


def _profile_spec(name: str) -> ProfileSpec:
    with _ledger() as conn:
        row = ledger_profiles.get(conn, name)
    if row is None:
        raise click.ClickException(f"no profile {name!r}")
    return parse_spec(row.spec)


def _only_chosen(settings: ListingSettings, chosen: tuple[str, ...]) -> ListingSettings:
    """``settings`` with only the MCP servers a profile chooses (all when it names none)."""
    if not chosen:
        return settings
    missing = sorted(set(chosen) - set(settings.servers))
    if missing:
        click.echo(f"vigil: the profile names MCP servers not in VIGIL_MCP_SERVERS: {', '.join(missing)}", err=True)
    servers = {name: spec for name, spec in json.loads(settings.mcp_servers or "{}").items() if name in chosen}
    return settings.model_copy(update={"mcp_servers": json.dumps(servers)})


@tools.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--profile", "profile_name", help="As runs of this agent profile see them (read from the ledger).")
def tools_list(as_json, profile_name) -> None:
    """Every tool a worker with these settings would offer: name, source package and version,
    permission. Loads tool packages and lists MCP servers' tools exactly as the worker does at
    start-up, so a name clash or a broken package fails here the same way. Exits 1 when an MCP
    server could not be listed (after listing the rest), 2 on a bad setting."""
    # Imported here on purpose: the registry brings the MCP SDK, about two seconds to import,
    # which no other `vigil` command needs.
    from vigil.agent.actions import ToolRegistry, effective_permissions

    settings = load_or_exit(ListingSettings)
    spec = _profile_spec(profile_name) if profile_name else None
    left_out: set[str] = set()
    if spec is not None:
        configured = set(settings.servers)
        settings = _only_chosen(settings, spec.mcp_servers)
        left_out = configured - set(settings.servers)
    try:
        registry = ToolRegistry.from_settings(settings)
        # A permission naming a tool of a server the profile leaves out is no typo: the worker
        # keeps it for that server (as for a server that is down), so the listing does too.
        permissions = effective_permissions(settings, registry.tools, [*registry.unreachable, *left_out])
    except SettingsError as exc:
        raise StartupError(str(exc)) from None
    rows = registry.listing(permissions)
    if spec is not None and spec.tools is not None:
        narrowed = tool_set(permissions, spec.tools)
        rows = [{**row, "permission": narrowed[row["name"]].value} for row in rows if row["name"] in narrowed]
    for row in rows:
        if as_json:
            click.echo(json.dumps(row))
        else:
            click.echo(f"{row['name']:<32} {row['permission']:<6} {row['source']} {row['version']}".rstrip())
    for server, reason in sorted(registry.unreachable.items()):
        click.echo(f"vigil: MCP server {server} offers no tools while it is down (not listed: {reason})", err=True)
    if registry.unreachable:
        sys.exit(1)


commands = [approvals, policies, tools]
