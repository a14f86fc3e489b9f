"""`vigil profiles create|update|show|list|assign`: agent profiles in the ledger
(docs/agent.md, "Profiles"). Every change writes one audit row in its transaction; a version
is never changed, an update adds the next one."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from vigil.admin.connection import cli_connection
from vigil.agent.actions import known_names
from vigil.agent.profiles import ProfileRefused, check_name, check_pattern, parse_spec
from vigil.agent.settings import MCP_SEPARATOR, parse_mcp_servers, parse_permissions
from vigil.cliutil import BIGINT_MAX, INT_MAX, Conflict, DecimalNumber, WholeNumber, emit, login_name, table
from vigil.ledger import audit
from vigil.ledger import budgets as ledger_budgets
from vigil.ledger import profiles as ledger_profiles


def _spec_options(command):
    """The options create and update share: each sets one field of the spec."""
    options = [
        click.option("--model", help="Claude model id (VIGIL_MODEL otherwise)."),
        click.option("--system-prompt", help="Text added after vigil's own system prompt."),
        click.option(
            "--system-prompt-file",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="... from a file.",
        ),
        click.option("--instructions-path", help="Memory file of the standing instructions (/memories/...)."),
        click.option("--max-turns", type=WholeNumber(0, INT_MAX), help="Most model calls in one run."),
        click.option("--max-run-tokens", type=WholeNumber(0, BIGINT_MAX), help="Most billed tokens one run may use."),
        click.option("--run-wall-s", type=DecimalNumber(0, INT_MAX), help="Wall time of one run."),
        click.option(
            "--tools",
            help="The tool set: name=permission,... (allow | ask | auto | deny); only these are offered; '': all.",
        ),
        click.option("--mcp-server", "mcp_servers", multiple=True, help="An MCP server the profile uses (repeat)."),
        click.option("--event-policies", help="Per source: chat=fold,pager=interrupt (queue | fold | interrupt)."),
        click.option(
            "--daily-tokens",
            type=WholeNumber(0, BIGINT_MAX),
            help="Billed tokens per user per UTC day; 0: no limit (an update releases the events waiting for it).",
        ),
        click.option(
            "--allow-unknown",
            is_flag=True,
            help="Accept tool and MCP server names this deployment does not know (a server added later).",
        ),
        click.option("--json", "as_json", is_flag=True, help="The version as one JSON object."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _changes(options: dict[str, Any]) -> dict[str, Any]:
    """The spec fields the options set (None: not given)."""
    changes = {}
    for key in ("model", "system_prompt", "instructions_path", "max_turns", "max_run_tokens", "run_wall_s"):
        if options[key] is not None:
            changes[key] = options[key]
    if options["system_prompt_file"] is not None:
        changes["system_prompt"] = options["system_prompt_file"].read_text()
    if options["tools"] is not None:
        try:
            changes["tools"] = {n: p.value for n, p in parse_permissions(options["tools"]).items()} or None
        except ValueError as exc:
            raise click.UsageError(f"--tools: {exc}") from None
    if options["mcp_servers"]:
        changes["mcp_servers"] = list(options["mcp_servers"])
    if options["event_policies"] is not None:
        changes["event_policies"] = options["event_policies"] or None
    if options["daily_tokens"] is not None:
        changes["daily_tokens"] = options["daily_tokens"]
    return changes


def _check_known(changes: dict[str, Any]) -> None:
    """Refuse tool and server names that VIGIL_MCP_SERVERS and the installed tools do not know:
    a typo would otherwise show only as a warning in the worker's log, on every run."""
    try:
        servers = set(parse_mcp_servers(os.environ.get("VIGIL_MCP_SERVERS", "")))
    except ValueError as exc:
        raise click.UsageError(f"VIGIL_MCP_SERVERS: {exc}") from None
    known = known_names()
    unknown = [f"tool {t}" for t in changes.get("tools") or {} if t not in known and not _of_server(t, servers)]
    unknown += [f"MCP server {s}" for s in changes.get("mcp_servers") or [] if s not in servers]
    if unknown:
        raise click.UsageError(
            f"no {', '.join(unknown)} here (VIGIL_MCP_SERVERS and the installed tools): "
            "--allow-unknown to save it anyway"
        )


def _of_server(tool: str, servers: set[str]) -> bool:
    server, separator, _ = tool.partition(MCP_SEPARATOR)
    return bool(separator) and server in servers


def _row(row: ledger_profiles.ProfileRow) -> dict[str, Any]:
    return asdict(row)


def _line(row: ledger_profiles.ProfileRow) -> str:
    return f"{row.name} v{row.version}  {json.dumps(row.spec, sort_keys=True)}"


def _save(name: str, options: dict[str, Any], *, new: bool) -> None:
    try:
        check_name(name)
        changes = _changes(options)
        if not options["allow_unknown"]:
            _check_known(changes)
        with cli_connection() as conn, conn.transaction():
            current = ledger_profiles.get(conn, name)
            if new and current is not None:
                raise Conflict(f"profile {name!r} exists (v{current.version}): use `vigil profiles update`")
            if not new and current is None:
                raise click.ClickException(f"no profile {name!r}: use `vigil profiles create`")
            base = current.spec if current else {}
            spec = parse_spec({k: v for k, v in (base | changes).items() if v is not None}).stored()
            row = ledger_profiles.add_version(
                conn, name=name, expect=current.version if current else 0, spec=spec, created_by=login_name()
            )
            if row is None:
                raise Conflict(f"profile {name!r} changed meanwhile: run the command again")
            detail: dict[str, Any] = {"name": name, "version": row.version}
            if not new and "daily_tokens" in changes:
                # Its users' events waiting for the old budget are due now, not at 00:00 UTC.
                # Its users' notices still queued are withdrawn: the wait they announce is over.
                released = ledger_budgets.release(conn, profile=name)
                detail["released"], detail["withdrawn_notices"] = released.events, released.notices
            action = "profile.create" if new else "profile.update"
            audit.record(conn, actor=login_name(), action=action, detail=detail)
    except ProfileRefused as exc:
        raise click.UsageError(str(exc)) from None
    emit(_row(row), options["as_json"], _line(row))


@click.group("profiles")
def profiles() -> None:
    """Agent profiles: model, prompt, limits, tools, budgets per group of users."""


@profiles.command("create")
@click.argument("name")
@_spec_options
def profiles_create(name, **options) -> None:
    """Create profile NAME (version 1); what it leaves out stays as the VIGIL_* settings have it."""
    _save(name, options, new=True)


@profiles.command("update")
@click.argument("name")
@_spec_options
def profiles_update(name, **options) -> None:
    """A new version of NAME: the latest with these changes. Sessions running keep their version."""
    _save(name, options, new=False)


@profiles.command("show")
@click.argument("name")
@click.option("--version", "version", type=WholeNumber(1, INT_MAX), help="This version (default: the latest).")
@click.option("--history", is_flag=True, help="Every version, oldest first.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def profiles_show(name, version, history, as_json) -> None:
    """A profile's latest version (or another, or its history)."""
    with cli_connection() as conn:
        found = ledger_profiles.get(conn, name, version)
        rows = ledger_profiles.history(conn, name) if history else [found] if found else []
    if not rows:
        raise click.ClickException(f"no profile {name!r}" + (f" version {version}" if version else ""))
    for row in rows:
        emit(_row(row), as_json, _line(row))


@profiles.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: profiles and assignments.")
def profiles_list(as_json) -> None:
    """Every profile's latest version, and which users get which profile."""
    with cli_connection() as conn:
        latest = ledger_profiles.latest(conn)
        assigned = ledger_profiles.assignments(conn)
    if as_json:
        click.echo(
            json.dumps(
                {"profiles": [_row(r) for r in latest], "assignments": [asdict(a) for a in assigned]}, default=str
            )
        )
        return
    table(
        [{"name": r.name, "version": r.version, "spec": json.dumps(r.spec, sort_keys=True)} for r in latest],
        ["name", "version", "spec"],
    )
    click.echo("")
    table([asdict(a) for a in assigned], ["pattern", "profile", "assigned_at"])


@profiles.command("assign")
@click.argument("pattern")
@click.argument("name", required=False)
@click.option("--remove", is_flag=True, help="Remove PATTERN's assignment (its users fall back).")
@click.option("--json", "as_json", is_flag=True, help="The assignment as one JSON object.")
def profiles_assign(pattern, name, remove, as_json) -> None:
    """Give the users PATTERN matches profile NAME: a user id, or a prefix ending in * (team-a/*).
    The most specific assignment wins: a user's exact id, then the longest matching pattern;
    users none matches get the default (the VIGIL_* settings)."""
    if remove == (name is not None):
        raise click.UsageError("give a profile NAME, or --remove")
    try:
        check_pattern(pattern)
    except ProfileRefused as exc:
        raise click.UsageError(str(exc)) from None
    with cli_connection() as conn, conn.transaction():
        if remove:
            row = ledger_profiles.unassign(conn, pattern)
            if row is None:
                raise click.ClickException(f"no assignment for {pattern!r}")
        else:
            if ledger_profiles.get(conn, name) is None:
                raise click.ClickException(f"no profile {name!r}")
            row = ledger_profiles.assign(conn, pattern=pattern, profile=name)
        action = "profile.unassign" if remove else "profile.assign"
        audit.record(conn, actor=login_name(), action=action, detail={"pattern": pattern, "profile": row.profile})
    text = f"{pattern}: {'no assignment' if remove else row.profile}"
    emit({**asdict(row), "removed": remove}, as_json, text)


commands = [profiles]
