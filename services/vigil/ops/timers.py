"""`vigil timers add|list|rm`: a user's timers, for operators and scripts (the same rules as the timers API)."""

from __future__ import annotations

import json
import time

import click

from vigil.admin.shards import Shards
from vigil.cliutil import INT_MAX, WholeNumber, emit
from vigil.ledger import timers as ledger
from vigil.scheduler.timers import InvalidTimer, describe, parse_timer
from vigil.service import load_or_exit
from vigil.settings import CommonSettings


@click.group("timers")
def timers_group() -> None:
    """Create, list and cancel a user's timers (the same rules as the HTTP API)."""


def _line(timer: dict) -> str:
    if timer["every"]:
        recurrence = f"every {timer['every']} s"
    elif timer["cron"]:
        recurrence = f"cron '{timer['cron']}' in {timer['tz']}"
    else:
        recurrence = "once"
    if timer["cancelled"]:
        state = "cancelled"
    elif timer["error"]:
        state = f"set aside: {timer['error']}"
    elif timer["done"]:
        state = "skipped" if timer["skipped"] else "fired"
    else:
        state = f"due {timer['due_at']}"
    return f"{timer['id']}  {timer['kind']}  {recurrence}  {timer['catch_up']}  {state}  fired {timer['fired_count']}x"


def _user_ledger(user_id: str):
    """The user's ledger shard, where their timers are (one shard: VIGIL_DATABASE_URL)."""
    return Shards(load_or_exit(CommonSettings)).user_connection(user_id)


@timers_group.command("add")
@click.argument("user_id")
@click.argument("timer_id")
@click.option("--due", help="First occurrence: epoch seconds or RFC 3339 with an offset (2026-03-08T09:00:00Z).")
@click.option("--every", type=WholeNumber(1, INT_MAX), help="Recur every this many seconds.")
@click.option("--cron", help="Recur by a 5-field cron expression (minute hour day month weekday), in --tz.")
@click.option("--tz", default="UTC", show_default=True, help="IANA time zone the cron expression is read in.")
@click.option(
    "--catch-up",
    "catch_up",
    type=click.Choice(["coalesce", "each", "skip"]),
    default="coalesce",
    show_default=True,
    help="After an outage: one event for the latest missed occurrence, one per occurrence, or none.",
)
@click.option("--max-lateness", type=WholeNumber(0, INT_MAX), help="Seconds: an occurrence older than this is skipped.")
@click.option("--payload", default="{}", help="JSON object copied into every event the timer fires.")
@click.option("--json", "as_json", is_flag=True, help="Print the stored timer as one JSON object.")
def timers_add(user_id, timer_id, due, every, cron, tz, catch_up, max_lateness, payload, as_json) -> None:
    """Create a timer, or re-register it (never re-firing an occurrence already fired)."""
    try:
        payload_obj = json.loads(payload)
    except ValueError as exc:
        raise click.UsageError(f"--payload is not JSON: {exc}") from None
    body = {
        "id": timer_id,
        "due": due,
        "every": every,
        "cron": cron,
        "tz": tz,
        "catch_up": catch_up,
        "max_lateness": max_lateness,
        "payload": payload_obj,
    }
    try:
        timer = parse_timer(user_id, {k: v for k, v in body.items() if v is not None}, int(time.time()))
    except InvalidTimer as exc:
        option = (
            "TIMER_ID"
            if exc.field == "id"
            else "USER_ID"
            if exc.field == "user_id"
            else f"--{exc.field.replace('_', '-')}"
        )
        raise click.UsageError(f"{option}: {exc.reason}") from None
    with _user_ledger(user_id) as conn:
        result = ledger.upsert(conn, timer)
    if result.status == "conflict":
        assert result.reason is not None  # a conflict says why
        raise click.ClickException(result.reason)
    assert result.row is not None  # the upsert returned it or read it, in one transaction
    shown = describe(result.row)
    note = f" ({result.reason})" if result.reason else ""
    emit({**shown, "status": result.status}, as_json, f"{result.status}: {_line(shown)}{note}")


@timers_group.command("list")
@click.argument("user_id")
@click.option("--all", "include_done", is_flag=True, help="Include fired, skipped and cancelled timers.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def timers_list(user_id, include_done, as_json) -> None:
    """List a user's timers, live ones only unless --all."""
    after = ""
    with _user_ledger(user_id) as conn:
        while True:
            rows = ledger.of_user(conn, user_id, include_done=include_done, after=after, limit=500)
            for row in rows:
                shown = describe(row)
                click.echo(json.dumps(shown) if as_json else _line(shown))
            if len(rows) < 500:
                break
            after = rows[-1].id


@timers_group.command("rm")
@click.argument("user_id")
@click.argument("timer_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def timers_rm(user_id, timer_id, as_json) -> None:
    """Cancel a live timer: it fires nothing more (its row stays, so a re-registration cannot re-fire)."""
    # A ledger that does not answer: one line and exit 3 (vigil.service.VigilGroup).
    with _user_ledger(user_id) as conn:
        if not ledger.cancel(conn, user_id=user_id, timer_id=timer_id):
            row = ledger.get(conn, user_id=user_id, timer_id=timer_id)
            if row is None:
                raise click.ClickException(f"no timer {timer_id!r} for user {user_id!r}")
            if row.kind == "approval_expiry":
                raise click.ClickException(f"{timer_id!r} is an approval's expiry timer: answer the approval instead")
            raise click.ClickException(f"timer {timer_id!r} is not live (already fired, skipped or cancelled)")
    emit({"cancelled": timer_id, "user_id": user_id}, as_json, f"cancelled timer {timer_id!r} of user {user_id!r}")


commands = [timers_group]
