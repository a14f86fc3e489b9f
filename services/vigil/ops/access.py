"""Who may send events: `vigil tokens ...` (API tokens) and `vigil hooks ...` (webhook endpoints).

A token or a secret is printed once, when it is made, and never again: the ledger keeps a
token's sha256 only. Hook secrets are kept in clear (an HMAC cannot be checked against a
hash), so `vigil hooks list` shows secret ids, never secrets. Every change is recorded in
the `audit` table in the same transaction, without the secret.
"""

from __future__ import annotations

import base64
import re
import secrets
import sys
from dataclasses import asdict
from datetime import UTC, datetime, timedelta

import click

from vigil.admin.connection import cli_connection
from vigil.cliutil import UserId, WholeNumber, emit, login_name
from vigil.ingest.auth import new_token, token_hash
from vigil.ingest.signatures import valid_standard_secret
from vigil.ledger import audit
from vigil.ledger import ingest as ledger
from vigil.ledger.states import HookProvider, Scope
from vigil.numbers import NotParsed, instant

ID_BYTES = 9  # 12 url-safe characters: unguessable enough for ids that are not secrets


def _ledger():
    """One transaction per command, committed when its block exits: the change with its audit row."""
    return cli_connection(autocommit=False)


def _audit(conn, action: str, detail: dict) -> None:
    audit.record(conn, actor=login_name(), action=action, detail=detail)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(ID_BYTES)


# -- tokens ------------------------------------------------------------------------------


@click.group("tokens")
def tokens() -> None:
    """Bearer tokens for POST /v1/events and /v1/users/{user}/messages."""


def _split(values: tuple[str, ...]) -> list[str] | None:
    items = [item.strip() for value in values for item in value.split(",") if item.strip()]
    return sorted(set(items)) or None


def _check_users(users: list[str] | None) -> None:
    for entry in users or ():
        bare = entry.removesuffix("*")
        if not entry.isprintable() or "*" in bare or (not bare and entry != "*"):
            raise click.BadParameter(f"{entry!r}: a user id, or a prefix ending in *", param_hint="--users")


# `--expires 30d`: a whole number of seconds, minutes, hours, days or weeks from now.
_LIFETIME = re.compile(r"([0-9]{1,6})([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def _expiry(text: str | None, now: datetime) -> datetime | None:
    """``--expires``: a lifetime (``30d``, ``12h``) or an RFC 3339 instant, in the future."""
    if text is None:
        return None
    lifetime = _LIFETIME.fullmatch(text.strip())
    try:
        when = now + timedelta(seconds=int(lifetime[1]) * _UNIT_S[lifetime[2]]) if lifetime else instant(text.strip())
    except NotParsed as exc:
        raise click.BadParameter(f"a lifetime such as 30d or 12h, or {exc}", param_hint="--expires") from None
    if when <= now:
        raise click.BadParameter(f"{when.isoformat()} is not in the future", param_hint="--expires")
    return when


@tokens.command("create")
@click.argument("name")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    help="What the token may do: events, messages, timers, approvals, admin (repeat or comma-separate). "
    "Default: everything.",
)
@click.option(
    "--users",
    "users",
    multiple=True,
    help="Users the token may act for: ids, or prefixes ending in * (repeat or comma-separate). Default: any user.",
)
@click.option(
    "--expires",
    help="When the token stops working: a lifetime (30d, 12h, 2w) or an RFC 3339 instant. Default: never.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the token as one JSON object.")
def token_create(
    name: str, scopes: tuple[str, ...], users: tuple[str, ...], expires: str | None, as_json: bool
) -> None:
    """Create a token called NAME; it is printed once and stored hashed."""
    expires_at = _expiry(expires, datetime.now(UTC))
    scope_list = _split(scopes)
    known = {scope.value for scope in Scope}
    for scope in scope_list or ():
        if scope not in known:
            raise click.BadParameter(f"{scope!r}: expected one of {', '.join(sorted(known))}", param_hint="--scope")
    user_list = _split(users)
    _check_users(user_list)
    token = new_token()
    with _ledger() as conn:
        row = ledger.create_token(
            conn,
            token_id=_new_id("tok_"),
            name=name,
            digest=token_hash(token),
            scopes=scope_list,
            users=user_list,
            expires_at=expires_at,
        )
        detail = {"id": row.id, "name": name, "scopes": scope_list, "users": user_list}
        _audit(conn, "token.create", {**detail, "expires_at": expires_at and expires_at.isoformat()})
    emit(
        {**asdict(row), "token": token},
        as_json,
        f"token {row.id} ({name}):\n  {token}\nShown once: store it now. Use it as `Authorization: Bearer <token>`.",
    )


@tokens.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def token_list(as_json: bool) -> None:
    """List tokens (never the tokens themselves)."""
    with _ledger() as conn:
        rows = ledger.tokens(conn)
    for row in rows:
        state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
        scope = ",".join(row.scopes) if row.scopes is not None else "all"
        users = ",".join(row.users) if row.users is not None else "any"
        expires = f"  expires {row.expires_at:%Y-%m-%d %H:%M}" if row.expires_at else ""
        emit(
            asdict(row),
            as_json,
            f"{row.id}  {row.name:<24} created {row.created_at:%Y-%m-%d %H:%M}  {state}  scope={scope} users={users}"
            + expires,
        )


@tokens.command("revoke")
@click.argument("token_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def token_revoke(token_id: str, as_json: bool) -> None:
    """Revoke a token by id; ingest refuses it within VIGIL_INGEST_AUTH_CACHE_S seconds."""
    with _ledger() as conn:
        row = ledger.revoke_token(conn, token_id)
        if row is None:
            known = ledger.token_exists(conn, token_id)
            raise click.ClickException(f"token {token_id} was revoked already" if known else f"no token {token_id}")
        _audit(conn, "token.revoke", {"id": token_id})
    emit({"revoked": token_id, "name": row.name}, as_json, f"revoked {token_id} ({row.name})")


# -- hooks -------------------------------------------------------------------------------


def new_secret(provider: HookProvider) -> str:
    """A signing secret in the form the provider's tooling expects."""
    raw = secrets.token_bytes(32)
    if provider is HookProvider.GITHUB:
        return raw.hex()  # pasted into the repository's webhook settings
    # Standard Webhooks: whsec_ + base64 of the key. Stripe issues its own secrets (pass
    # them with --secret-stdin); this form is what Stripe's look like.
    return "whsec_" + base64.b64encode(raw).decode()


def _secret(provider: HookProvider, from_stdin: bool) -> tuple[str, bool]:
    """(secret, generated). Providers that issue their own secrets pass them on stdin,
    which keeps them out of shell history and process listings."""
    if not from_stdin:
        return new_secret(provider), True
    secret = sys.stdin.readline().strip()
    if len(secret) < 16:
        raise click.ClickException("the secret on stdin is shorter than 16 characters")
    if provider is HookProvider.STANDARD_WEBHOOKS and not valid_standard_secret(secret):
        raise click.ClickException("a standard-webhooks secret is whsec_ followed by base64 of at least 16 bytes")
    return secret, False


def _print_secret(obj: dict, as_json: bool, generated: bool, intro: str) -> None:
    if not generated:
        obj.pop("secret")  # the operator has it already; no need to echo it
    text = intro + (
        f"\n  secret: {obj['secret']}\nShown once: store it in the provider's settings now." if generated else ""
    )
    emit(obj, as_json, text)


@click.group("hooks")
def hooks() -> None:
    """Webhook endpoints: POST /v1/hooks/<id>, one provider and one user each."""


@hooks.command("add")
@click.option("--provider", type=click.Choice([p.value for p in HookProvider]), required=True)
@click.option("--user", "user_id", type=UserId(), required=True, help="The user whose agent the deliveries wake.")
@click.option("--secret-stdin", is_flag=True, help="Read the secret from stdin (Stripe issues its own).")
@click.option("--json", "as_json", is_flag=True, help="Print the hook as one JSON object, secret included.")
def hook_add(provider: str, user_id: str, secret_stdin: bool, as_json: bool) -> None:
    """Create a hook; its secret is printed once."""
    kind = HookProvider(provider)
    secret, generated = _secret(kind, secret_stdin)
    with _ledger() as conn:
        hook = ledger.create_hook(conn, hook_id=_new_id("hk_"), provider=kind.value, user_id=user_id)
        added = ledger.add_secret(conn, hook_id=hook.id, secret=secret)
        assert added is not None  # the hook was created enabled in this transaction
        _audit(conn, "hook.add", {"id": hook.id, "provider": kind.value, "user_id": user_id, "secret_id": added.id})
    obj = {**asdict(hook), "path": f"/v1/hooks/{hook.id}", "secret_id": added.id, "secret": secret}
    _print_secret(obj, as_json, generated, f"hook {hook.id} ({kind.value}, user {user_id}): POST /v1/hooks/{hook.id}")


@hooks.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def hook_list(as_json: bool) -> None:
    """List hooks with the ids of their active secrets."""
    with _ledger() as conn:
        rows = ledger.hooks(conn)
    for row in rows:
        state = "disabled" if row.disabled_at else f"secrets {row.active_secret_ids}"
        emit(asdict(row), as_json, f"{row.id}  {row.provider:<17} user {row.user_id:<20} {state}")


@hooks.command("rotate")
@click.argument("hook_id")
@click.option("--secret-stdin", is_flag=True, help="Read the new secret from stdin.")
@click.option("--json", "as_json", is_flag=True, help="Print the new secret as one JSON object.")
def hook_rotate(hook_id: str, secret_stdin: bool, as_json: bool) -> None:
    """Add a secret to HOOK; the older ones stay valid until `hooks revoke-secret`."""
    with _ledger() as conn:
        hook = ledger.hook(conn, hook_id)
        if hook is None or hook.disabled_at is not None:
            raise click.ClickException(f"no active hook {hook_id}")
        secret, generated = _secret(HookProvider(hook.provider), secret_stdin)
        added = ledger.add_secret(conn, hook_id=hook_id, secret=secret)
        if added is None:
            raise click.ClickException(f"hook {hook_id} was disabled meanwhile")
        _audit(conn, "hook.rotate", {"id": hook_id, "secret_id": added.id})
    obj = {"hook_id": hook_id, "secret_id": added.id, "secret": secret}
    _print_secret(obj, as_json, generated, f"secret {added.id} added to {hook_id}; older secrets stay valid")


@hooks.command("revoke-secret")
@click.argument("hook_id")
@click.argument("secret_id", type=WholeNumber(1))
@click.option(
    "--force", is_flag=True, help="Revoke even the last active secret (the hook then refuses every delivery)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def hook_revoke_secret(hook_id: str, secret_id: int, force: bool, as_json: bool) -> None:
    """Revoke one secret of HOOK (see `hooks list` for ids); effective within VIGIL_INGEST_AUTH_CACHE_S."""
    with _ledger() as conn:
        if not ledger.lock_hook(conn, hook_id):
            raise click.ClickException(f"no hook {hook_id}")
        row = ledger.revoke_secret(conn, hook_id, secret_id, force=force)
        if row is None:
            known = ledger.secret(conn, hook_id, secret_id)
            if known is None:
                raise click.ClickException(f"hook {hook_id} has no secret {secret_id}")
            if known.revoked_at is not None:
                raise click.ClickException(f"secret {secret_id} was revoked already")
            raise click.ClickException(f"secret {secret_id} is the last active one; rotate first, or use --force")
        _audit(conn, "hook.revoke_secret", {"id": hook_id, "secret_id": secret_id, "forced": force})
    emit({"hook": hook_id, "revoked_secret": secret_id}, as_json, f"revoked secret {secret_id} of {hook_id}")


@hooks.command("disable")
@click.argument("hook_id")
def hook_disable(hook_id: str) -> None:
    """Disable HOOK: its deliveries get 404 within VIGIL_INGEST_AUTH_CACHE_S. Its rows stay for audit."""
    with _ledger() as conn:
        row = ledger.disable_hook(conn, hook_id)
        if row is None:
            if not ledger.lock_hook(conn, hook_id):
                raise click.ClickException(f"no hook {hook_id}")
            raise click.ClickException(f"hook {hook_id} is disabled already")
        _audit(conn, "hook.disable", {"id": hook_id})
    click.echo(f"disabled {hook_id} ({row.provider} for {row.user_id})")


commands = [tokens, hooks]
