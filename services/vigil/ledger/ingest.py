"""API tokens and webhook hooks: typed functions over ``queries/ingest.sql``.

Ingest reads them on its hot path (:func:`token_by_hash`, :func:`hook_for_delivery`, each
cached by ingest; :func:`token_hashes` and :func:`hook_ids` feed its negative caches);
``vigil tokens`` and ``vigil hooks`` write them. A revocation sets a timestamp once and never
clears it, so each write checks "still active" and returns None when it found nothing to do.
Only a token's sha256 is stored; hook secrets cannot be hashed (an HMAC is checked with the
secret itself), so they are sealed with ``VIGIL_SECRET_KEY`` (:mod:`vigil.ledger.sealing`) and
leave this module, opened, only in :class:`Hook`, the delivery check's view.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from psycopg.rows import DictRow

from vigil.ledger import sealing
from vigil.ledger.queries import Q

log = logging.getLogger(__name__)

T = TypeVar("T")


def _row(cls: type[T], row: dict[str, Any] | None) -> T | None:
    if row is None:
        return None
    return cls(**{f.name: row[f.name] for f in fields(cls)})  # type: ignore[arg-type]


# -- tokens ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuthToken:
    """A token as a request's authentication needs it (``scopes``/``users`` None: unrestricted)."""

    id: str
    name: str
    revoked_at: datetime | None
    scopes: list[str] | None
    users: list[str] | None
    expires_at: datetime | None = None  # refused from then on; None: never

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True, slots=True)
class Token:
    """A token as ``vigil tokens`` shows it: never its hash."""

    id: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
    scopes: list[str] | None
    users: list[str] | None
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class NewToken:
    id: str
    name: str
    created_at: datetime
    scopes: list[str] | None
    users: list[str] | None
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class RevokedToken:
    id: str
    name: str
    revoked_at: datetime


async def token_by_hash(conn: psycopg.AsyncConnection[DictRow], digest: str) -> AuthToken | None:
    """The token whose sha256 is ``digest``, revoked or not."""
    cursor = await conn.execute(Q.token_by_hash, {"token_hash": digest})
    return _row(AuthToken, await cursor.fetchone())


def auth_token(conn: psycopg.Connection[DictRow], digest: str) -> AuthToken | None:
    """:func:`token_by_hash` on a sync connection (the console's login)."""
    return _row(AuthToken, conn.execute(Q.token_by_hash, {"token_hash": digest}).fetchone())


async def token_hashes(conn: psycopg.AsyncConnection[DictRow]) -> frozenset[str]:
    """Every token's hash (ingest's negative cache)."""
    cursor = await conn.execute(Q.token_hashes)
    return frozenset(row["token_hash"] for row in await cursor.fetchall())


def all_token_hashes(conn: psycopg.Connection[DictRow]) -> frozenset[str]:
    """:func:`token_hashes` on a sync connection (the console's negative cache)."""
    return frozenset(row["token_hash"] for row in conn.execute(Q.token_hashes).fetchall())


def create_token(
    conn: psycopg.Connection[DictRow],
    *,
    token_id: str,
    name: str,
    digest: str,
    scopes: list[str] | None,
    users: list[str] | None,
    expires_at: datetime | None = None,
) -> NewToken:
    row = conn.execute(
        Q.token_create,
        {
            "id": token_id,
            "name": name,
            "token_hash": digest,
            "scopes": scopes,
            "users": users,
            "expires_at": expires_at,
        },
    ).fetchone()
    return _row(NewToken, row)  # type: ignore[return-value]


def tokens(conn: psycopg.Connection[DictRow]) -> list[Token]:
    """Every token, newest first."""
    return [_row(Token, r) for r in conn.execute(Q.token_list).fetchall()]  # type: ignore[misc]


def revoke_token(conn: psycopg.Connection[DictRow], token_id: str) -> RevokedToken | None:
    """None: unknown, or revoked already (:func:`token_exists` tells which)."""
    return _row(RevokedToken, conn.execute(Q.token_revoke, {"id": token_id}).fetchone())


def token_exists(conn: psycopg.Connection[DictRow], token_id: str) -> bool:
    return conn.execute(Q.token_get, {"id": token_id}).fetchone() is not None


# -- hooks -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hook:
    """A hook and its active secrets, as a delivery's check needs them."""

    id: str
    provider: str
    user_id: str
    disabled_at: datetime | None
    secrets: list[str]


@dataclass(frozen=True, slots=True)
class ListedHook:
    """A hook as ``vigil hooks list`` shows it: the ids of its active secrets, never the secrets."""

    id: str
    provider: str
    user_id: str
    created_at: datetime
    disabled_at: datetime | None
    active_secret_ids: list[int]


@dataclass(frozen=True, slots=True)
class NewHook:
    id: str
    provider: str
    user_id: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class DisabledHook:
    id: str
    provider: str
    user_id: str
    disabled_at: datetime


@dataclass(frozen=True, slots=True)
class Secret:
    """One signing secret's state, never its value."""

    id: int
    hook_id: str
    created_at: datetime | None = None
    revoked_at: datetime | None = None


def _hook(row: dict[str, Any] | None) -> Hook | None:
    if row is None:
        return None
    keys = sealing.keys()
    place = sealing.Place("hook_secrets", row["id"])
    opened = []
    for secret, sealed_with in zip(row["secrets"], row["sealed_with"], strict=True):
        try:
            opened.append(keys.open(secret, sealed_with, place))
        except sealing.SecretKeyError as exc:
            # A seal that does not open here (copied from another hook's row, or altered)
            # verifies nothing: the delivery is refused as unsigned, not a 500 (issue 58).
            log.warning("hook %s: a secret is left out: %s", row["id"], exc)
    return Hook(row["id"], row["provider"], row["user_id"], row["disabled_at"], opened)


async def hook_for_delivery(conn: psycopg.AsyncConnection[DictRow], hook_id: str) -> Hook | None:
    cursor = await conn.execute(Q.hook_for_delivery, {"hook_id": hook_id})
    return _hook(await cursor.fetchone())


async def hook_ids(conn: psycopg.AsyncConnection[DictRow]) -> frozenset[str]:
    """Every hook id (ingest's negative cache)."""
    cursor = await conn.execute(Q.hook_ids)
    return frozenset(row["id"] for row in await cursor.fetchall())


def hook(conn: psycopg.Connection[DictRow], hook_id: str) -> Hook | None:
    """:func:`hook_for_delivery` for the CLI."""
    return _hook(conn.execute(Q.hook_for_delivery, {"hook_id": hook_id}).fetchone())


def create_hook(conn: psycopg.Connection[DictRow], *, hook_id: str, provider: str, user_id: str) -> NewHook:
    row = conn.execute(Q.hook_create, {"id": hook_id, "provider": provider, "user_id": user_id}).fetchone()
    return _row(NewHook, row)  # type: ignore[return-value]


def hooks(conn: psycopg.Connection[DictRow]) -> list[ListedHook]:
    """Every hook, newest first."""
    return [_row(ListedHook, r) for r in conn.execute(Q.hook_list).fetchall()]  # type: ignore[misc]


def add_secret(conn: psycopg.Connection[DictRow], *, hook_id: str, secret: str) -> Secret | None:
    """Add a signing secret, sealed with the current key; None: no such hook, or it is disabled."""
    stored, sealed_with = sealing.keys().seal(secret, sealing.Place("hook_secrets", hook_id))
    row = conn.execute(Q.hook_secret_add, {"hook_id": hook_id, "secret": stored, "sealed_with": sealed_with}).fetchone()
    return None if row is None else Secret(row["id"], row["hook_id"], created_at=row["created_at"])


def lock_hook(conn: psycopg.Connection[DictRow], hook_id: str) -> bool:
    """Lock a hook until commit (serialises changes to its secrets); False: no such hook."""
    return conn.execute(Q.hook_lock, {"hook_id": hook_id}).fetchone() is not None


def revoke_secret(conn: psycopg.Connection[DictRow], hook_id: str, secret_id: int, *, force: bool) -> Secret | None:
    """Revoke an active secret; unless ``force``, only while another stays active. None:
    nothing revoked (:func:`secret` tells why)."""
    row = conn.execute(Q.hook_secret_revoke, {"hook_id": hook_id, "secret_id": secret_id, "force": force}).fetchone()
    return None if row is None else Secret(row["id"], row["hook_id"], revoked_at=row["revoked_at"])


def secret(conn: psycopg.Connection[DictRow], hook_id: str, secret_id: int) -> Secret | None:
    return _row(Secret, conn.execute(Q.hook_secret_get, {"hook_id": hook_id, "secret_id": secret_id}).fetchone())


def disable_hook(conn: psycopg.Connection[DictRow], hook_id: str) -> DisabledHook | None:
    """None: unknown, or disabled already."""
    return _row(DisabledHook, conn.execute(Q.hook_disable, {"hook_id": hook_id}).fetchone())
