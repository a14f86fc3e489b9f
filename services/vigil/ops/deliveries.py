"""Where and how often users are reached: `vigil channels`, `vigil outbox`, `vigil users`."""

from __future__ import annotations

from contextlib import contextmanager

import click

from vigil.admin.shards import Shards, report_down, with_shard
from vigil.cliutil import INT_MAX, UserId, WholeNumber, emit
from vigil.dispatcher.operator import (
    KEEP,
    ChannelError,
    dead_deliveries,
    outbox_rows,
    revive_delivery,
    set_attention,
    set_channel,
    show_channel,
    show_user,
    to_json,
)
from vigil.dispatcher.settings import DispatcherSettings
from vigil.ledger import db
from vigil.ledger.states import ChannelType
from vigil.numbers import NotParsed, whole_number
from vigil.outbound import address_policy
from vigil.service import load_or_exit


class Limit(click.ParamType):
    """A whole number of seconds or deliveries, or `default` (back to the service setting)."""

    name = "N|default"
    keyword = "default"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int):
            return value
        if str(value).strip().lower() == self.keyword:
            return None
        try:  # an integer column: past INT_MAX the ledger would refuse with a traceback
            return whole_number(str(value), 0, INT_MAX)
        except NotParsed as exc:
            self.fail(f"{exc}, or {self.keyword!r}", param, ctx)


class AutoGap(Limit):
    """Seconds, or `auto`: the earned gap adapts again."""

    name = "N|auto"
    keyword = "auto"


def _settings():
    return load_or_exit(DispatcherSettings)


def _connect(settings):
    return db.connect(settings.dsn, autocommit=True)


@contextmanager
def _user_and_catalog(settings, user: str):
    """The user's shard (pacing, attention) and, with several shards, the catalog (channels);
    one shard: one connection, the catalog None."""
    shards = Shards(settings)
    with shards.user_connection(user) as conn:
        if not shards.many:
            yield conn, None
            return
        with shards.connection(0) as catalog:
            yield conn, catalog


@click.group("channels")
def channels() -> None:
    """Where each user's deliveries go: webhook, kafka or log (the default)."""


@channels.command("set")
@click.argument("user", type=UserId())
@click.option("--type", "type_", type=click.Choice([t.value for t in ChannelType]), required=True, help="Channel type.")
@click.option("--url", help="Webhook target (--type webhook).")
@click.option("--gap", type=Limit(), help="Seconds between deliveries for this user, or 'default'.")
@click.option("--urgent-cap", type=Limit(), help="Urgent gap bypasses a day for this user, or 'default'.")
@click.option("--rotate-secret", is_flag=True, help="Webhook: generate a new signing secret (printed once).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def channels_set(user, type_, url, gap, urgent_cap, rotate_secret, as_json) -> None:
    """Set USER's channel. A new webhook's signing secret is printed once: store it then.

    \b
    vigil channels set alice --type webhook --url https://example.com/hooks/vigil
    vigil channels set alice --type webhook --url https://example.com/hooks/vigil --gap 600 --urgent-cap 2
    vigil channels set bob --type kafka
    vigil channels set carol --type log --gap default
    """
    settings = _settings()
    gap_source = click.get_current_context().get_parameter_source("gap")
    cap_source = click.get_current_context().get_parameter_source("urgent_cap")
    given = click.core.ParameterSource.COMMANDLINE
    with _connect(settings) as conn:
        try:
            result = set_channel(
                conn,
                user,
                ChannelType(type_),
                url,
                gap_seconds=gap if gap_source == given else KEEP,
                urgent_cap=urgent_cap if cap_source == given else KEEP,
                rotate_secret=rotate_secret,
                policy=address_policy(settings),
            )
        except ChannelError as exc:
            raise click.UsageError(str(exc)) from None
    row = result.row
    shown = {k: row[k] for k in ("user_id", "type", "url", "gap_seconds", "urgent_daily_cap")}
    gap_text = (
        f"gap {row['gap_seconds']}s" if row["gap_seconds"] is not None else f"gap {settings.outbox_gap}s (default)"
    )
    cap_text = (
        f"urgent cap {row['urgent_daily_cap']}/day"
        if row["urgent_daily_cap"] is not None
        else f"urgent cap {settings.urgent_daily_cap}/day (default)"
    )
    text = f"{user}: {row['type']}{' ' + row['url'] if row['url'] else ''}, {gap_text}, {cap_text}"
    if result.new_secret:
        shown["secret"] = result.new_secret
        text += (
            f"\nsigning secret (shown only now; the receiver verifies webhook-signature with it):\n{result.new_secret}"
        )
    emit(shown, as_json, text)


@channels.command("show")
@click.argument("user")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def channels_show(user, as_json) -> None:
    """Show USER's channel, the limits in effect and the pacing state (never the secret)."""
    settings = _settings()
    with _user_and_catalog(settings, user) as (conn, catalog):
        shown = show_channel(conn, user, settings.outbox_gap, settings.urgent_daily_cap, catalog)
    if as_json:
        click.echo(to_json(shown))
        return
    lines = [
        f"user:        {user}",
        f"channel:     {shown['type']}{'' if shown['configured'] else ' (no channel set: the default)'}",
    ]
    if shown["url"]:
        lines.append(f"url:         {shown['url']}  (signing secret {'set' if shown['secret_set'] else 'MISSING'})")
    lines += [
        f"gap:         {shown['gap_seconds']}s{' (default)' if shown['gap_is_default'] else ''}",
        f"urgent cap:  {shown['urgent_daily_cap']}/day{' (default)' if shown['urgent_cap_is_default'] else ''}, "
        f"used today: {shown['urgent_today']}",
        f"last delivery: {shown['last_delivery_at'] or 'never'}",
    ]
    emit(shown, False, "\n".join(lines))


def _preview(body: str, width: int = 60) -> str:
    flat = " ".join(body.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


@click.command("outbox")
@click.argument("user", required=False)
@click.option("--dead", is_flag=True, help="List dead deliveries of every user instead.")
@click.option("--revive", "revive_id", metavar="DELIVERY_ID", help="Send a dead delivery again under its own id.")
@click.option("--limit", type=WholeNumber(1, 10_000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def outbox(user, dead, revive_id, limit, as_json) -> None:
    """USER's outbox rows (status, attempts, delivery id, error; --json: session, deadline), newest first.

    \b
    vigil outbox alice
    vigil outbox --dead
    vigil outbox --revive 2f1c...   (a dead delivery, same id, attempts start over)
    """
    if sum(bool(x) for x in (user, dead, revive_id)) != 1:
        raise click.UsageError("give exactly one of USER, --dead, --revive DELIVERY_ID")
    settings = _settings()
    shards = Shards(settings)
    down: list = []
    if revive_id:
        # A delivery id is a UUID: the first shard that holds it dead revives it.
        found = shards.locate(lambda dsn: _revive(dsn, revive_id) or None, f"dead delivery {revive_id}", unique=True)
        if found is None:
            raise click.ClickException(f"no dead delivery {revive_id}")
        rows = found.value
        text = f"delivery {revive_id}: {len(rows)} messages back to pending for {rows[0]['user_id']}"
        emit({"revived": revive_id, "user_id": rows[0]["user_id"], "messages": len(rows)}, as_json, text)
        return
    if dead:
        merged, down = shards.merged(lambda dsn: _read(dsn, dead_deliveries, limit), lambda r: r["dead_at"], limit)
        rows = [with_shard(f.value, f.shard, shards) for f in merged]
    else:
        rows = shards.on_user(user, lambda dsn: _read(dsn, outbox_rows, user, limit))
    _print_outbox(rows, user, dead, as_json)
    report_down(down)


def _read(dsn: str, fn, *args):
    with db.connect(dsn, autocommit=True) as conn:
        return fn(conn, *args)


def _revive(dsn: str, delivery_id: str) -> list[dict]:
    with db.connect(dsn, autocommit=True) as conn:
        return revive_delivery(conn, delivery_id)


def _print_outbox(rows: list[dict], user: str | None, dead: bool, as_json: bool) -> None:
    if as_json:
        for row in rows:
            click.echo(to_json(row))
        return
    if not rows:
        click.echo("no dead deliveries" if dead else f"no outbox rows for {user}")
        return
    if dead:
        for row in rows:
            shard = f"shard {row['shard']}  " if "shard" in row else ""
            click.echo(
                f"{shard}{row['dead_at']:%Y-%m-%d %H:%M:%S}  {row['delivery_id']}  {row['user_id']}  "
                f"{row['channel'] or '-'}  "
                f"{row['messages']} msg  {row['attempts']} attempts  {row['error']}"
            )
        return
    click.echo(
        f"{'id':>8}  {'run':>8}  {'status':<9}  {'att':>3}  {'delivery id':<36}  {'channel':<7}  created / body / error"
    )
    for row in rows:
        urgent = " URGENT" if row["urgent"] else ""
        click.echo(
            f"{row['id']:>8}  {row['run_id']:>8}  {row['status']:<9}  {row['attempts']:>3}  "
            f"{str(row['delivery_id'] or '-'):<36}  "
            f"{row['channel'] or '-':<7}  {row['created_at']:%Y-%m-%d %H:%M:%S}{urgent}  {_preview(row['body'])}"
            + (f"  error: {row['error']}" if row["error"] else "")
        )


@click.group("users")
def users() -> None:
    """Users' attention: the gap between deliveries each has earned, and overrides."""


@users.command("show")
@click.argument("user")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def users_show(user, as_json) -> None:
    """Show USER's effective gap, where it comes from and why, and today's deliveries."""
    settings = _settings()
    with _user_and_catalog(settings, user) as (conn, catalog):
        shown = show_user(conn, user, settings.outbox_gap, catalog)
    if shown is None:
        raise click.ClickException(f"no user {user!r}")
    text = "\n".join(
        [
            f"user:        {user}",
            f"gap:         {shown['gap_seconds']}s ({shown['gap_source']}: {shown['reason']})",
            f"deliveries today: {shown['deliveries_today']}, last: {shown['last_delivery_at'] or 'never'}",
        ]
    )
    emit(shown, as_json, text)


@users.command("attention")
@click.argument("user")
@click.option("--gap", type=AutoGap(), required=True, help="Pin USER's gap at N seconds, or 'auto' to adapt again.")
def users_attention(user, gap) -> None:
    """Override USER's earned gap (pinned until `--gap auto`). A channel's --gap still wins.

    \b
    vigil users attention alice --gap 1800
    vigil users attention alice --gap auto
    """
    settings = _settings()
    with _user_and_catalog(settings, user) as (conn, catalog):
        if not set_attention(conn, user, gap):
            raise click.ClickException(f"no user {user!r}")
        shown = show_user(conn, user, settings.outbox_gap, catalog)
    assert shown is not None
    click.echo(f"{user}: gap {shown['gap_seconds']}s ({shown['gap_source']}: {shown['reason']})")


commands = [channels, outbox, users]
