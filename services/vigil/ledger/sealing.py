"""Secrets at rest: hook signing secrets and channel secrets, sealed with ``VIGIL_SECRET_KEY``.

A secret that must be used in clear (an HMAC key cannot be checked against a hash) is stored
sealed with AES-256-GCM (``cryptography``'s AESGCM; the key derived from ``VIGIL_SECRET_KEY``
by HKDF-SHA256) as ``v2:<base64url of nonce and ciphertext>``, beside the id of the key
that sealed it (``sealed_with``: the first 12 hex digits of the key's sha256). The ledger's
functions seal on write and open on read, so a row read straight from PostgreSQL, a dump or
a backup holds no usable secret.

The seal is bound to its place (:class:`Place`: table, owner, column) as associated data:
a sealed value copied into another row (another hook's, another user's channel) does not
open there, so whoever can write the ledger cannot swap secrets between rows (issue 58).
The owner is the row's stable key: ``channels`` the user id, ``hook_secrets`` the hook id
(its secrets are one hook's, interchangeable; the row id is not known before the insert).
Rows sealed before (Fernet, no associated data) still open; ``vigil secrets rotate`` and
``vigil migrate`` (with the key set) seal them again in the bound form.

Keys: ``VIGIL_SECRET_KEY`` seals every new secret and opens its own rows;
``VIGIL_SECRET_OLD_KEYS`` (comma separated) only open rows during a rotation.
``vigil secrets rotate`` re-seals every row not sealed with the current key, clear ones
included, one row per statement, so an interrupted rotation is finished by running it again.
Without any key, secrets are stored in clear (a warning at start-up) and a service refuses
to start once a sealed row exists (:func:`check`), naming the setting. With
``VIGIL_ENV=production`` no key is refused instead, by :meth:`Keys.require_key`: the one rule
the services apply at start-up and every command that stores a secret meets in
:meth:`Keys.seal`, before anything is written.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import secrets
from dataclasses import dataclass, field
from functools import cache

import psycopg
from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from psycopg.rows import DictRow

from vigil.errors import VigilError
from vigil.ledger.queries import Q
from vigil.settings import SettingsError

log = logging.getLogger(__name__)

KEY_SETTING = "VIGIL_SECRET_KEY"
OLD_KEYS_SETTING = "VIGIL_SECRET_OLD_KEYS"
ENV_SETTING = "VIGIL_ENV"  # validated by vigil.settings.CommonSettings.env before any command runs
PRODUCTION = "production"


BOUND = "v2:"  # the prefix of a seal bound to its place; anything else sealed is a Fernet token
NONCE_BYTES = 12


@dataclass(frozen=True, slots=True)
class Place:
    """Where a sealed secret lives: the associated data its seal is bound to."""

    table: str
    owner: str  # the row's stable key: channels.user_id, hook_secrets.hook_id
    column: str = "secret"

    def data(self) -> bytes:
        # Length-prefixed, so no owner containing the separator can forge another place.
        parts = (self.table, self.owner, self.column)
        return b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)


def _aead(key: str) -> AESGCM:
    derived = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"vigil sealed secrets v2").derive(
        base64.urlsafe_b64decode(key.encode())
    )
    return AESGCM(derived)


class SecretKeyError(VigilError):
    """A sealed secret cannot be opened with the keys this process has; names the setting."""


class SecretMisplaced(SecretKeyError):
    """A sealed secret does not open in its row: altered, or copied from another row."""


def key_id(key: str) -> str:
    """The id stored beside each sealed secret: not the key, and stable across restarts."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def new_key() -> str:
    return Fernet.generate_key().decode()


@dataclass(frozen=True)
class Keys:
    """The keys this process has: ``current`` seals, every one of them opens."""

    current: str | None = None
    old: tuple[str, ...] = ()
    # VIGIL_ENV=production: a secret is never stored in clear, no key is an error instead.
    clear_refused: bool = False
    _openers: dict[str, Fernet] = field(default_factory=dict, init=False, repr=False, compare=False)
    _aeads: dict[str, AESGCM] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in (*self.old, *([self.current] if self.current else [])):
            self._openers[key_id(key)] = Fernet(key.encode())
            self._aeads[key_id(key)] = _aead(key)

    @property
    def current_id(self) -> str | None:
        return key_id(self.current) if self.current else None

    @property
    def ids(self) -> frozenset[str]:
        """The ids of every key held: the rows these keys open."""
        return frozenset(self._openers)

    def require_key(self) -> None:
        """SecretKeyError, naming the setting, if this profile refuses secrets in clear and
        there is no key to seal with."""
        if self.clear_refused and not self.current:
            raise SecretKeyError(
                f"{KEY_SETTING} is not set and {ENV_SETTING}={PRODUCTION}: hook and channel secrets would be "
                "stored in clear (`vigil secrets new-key` makes one)"
            )

    def seal(self, secret: str, place: Place) -> tuple[str, str | None]:
        """(stored text, sealed_with): the seal bound to ``place`` and the key's id; in clear
        without a key, or SecretKeyError where that is refused (:meth:`require_key`)."""
        if not self.current:
            self.require_key()
            return secret, None
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = self._aeads[key_id(self.current)].encrypt(nonce, secret.encode(), place.data())
        return BOUND + base64.urlsafe_b64encode(nonce + sealed).decode(), key_id(self.current)

    def open(self, stored: str, sealed_with: str | None, place: Place) -> str:
        """The secret of the row at ``place``; SecretKeyError if no key held sealed it, or it
        does not open there (altered, or copied from another row)."""
        if sealed_with is None:
            return stored
        opener = self._openers.get(sealed_with)
        if opener is None:
            raise SecretKeyError(_missing(sealed_with, self.current))
        try:
            if not stored.startswith(BOUND):
                return opener.decrypt(stored.encode()).decode()  # sealed before issue 58: Fernet
            raw = base64.urlsafe_b64decode(stored[len(BOUND) :].encode())
            return self._aeads[sealed_with].decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], place.data()).decode()
        except (InvalidToken, InvalidTag, ValueError):
            raise SecretMisplaced(
                f"a secret sealed with key {sealed_with} does not open in {place.table} row {place.owner!r}"
                " (altered, or copied from another row?)"
            ) from None


def opened_or_left_out(stored: str | None, sealed_with: str | None, place: Place) -> str | None:
    """The secret of the row at ``place``, or None, with a warning, where it does not open
    there: one altered or copied row must not stop a service's other users (its channel or
    hook then has no secret, and what needs one is refused with a reason). A key this
    process lacks is still SecretKeyError: that is the deployment's, not a row's."""
    if stored is None:
        return None
    try:
        return keys().open(stored, sealed_with, place)
    except SecretMisplaced as exc:
        log.warning("%s row %r: its secret is left out: %s", place.table, place.owner, exc)
        return None


def _missing(sealed_with: str, current: str | None) -> str:
    if current is None:
        return f"the ledger holds secrets sealed with key {sealed_with} and {KEY_SETTING} is not set"
    return (
        f"the ledger holds secrets sealed with key {sealed_with}, which is neither {KEY_SETTING} "
        f"(key {key_id(current)}) nor one of {OLD_KEYS_SETTING}"
    )


def from_environment(environ: dict[str, str] | None = None) -> Keys:
    env = os.environ if environ is None else environ
    current = env.get(KEY_SETTING, "").strip() or None
    old = tuple(k.strip() for k in env.get(OLD_KEYS_SETTING, "").split(",") if k.strip())
    try:
        return Keys(current, old, clear_refused=env.get(ENV_SETTING) == PRODUCTION)
    except ValueError:
        raise SettingsError(f"{KEY_SETTING} or {OLD_KEYS_SETTING}: not a Fernet key") from None


@cache
def keys() -> Keys:
    """This process's keys, read once from the environment (the settings validated them at
    start-up; read here so that every ledger function seals and opens alike without each
    caller passing them)."""
    return from_environment()


# -- what the ledger holds ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyUse:
    table: str
    sealed_with: str | None  # None: in clear
    secrets: int


def uses(conn: psycopg.Connection[DictRow]) -> list[KeyUse]:
    """How many secrets each key sealed, per table (``vigil secrets status``)."""
    return [KeyUse(r["tbl"], r["sealed_with"], r["secrets"]) for r in conn.execute(Q.secrets_by_key).fetchall()]


def check(conn: psycopg.Connection[DictRow], held: Keys) -> int:
    """Refuse (SecretKeyError, naming the setting) if a sealed row cannot be opened with
    ``held``; returns how many secrets are still in clear."""
    clear = 0
    for use in uses(conn):
        if use.sealed_with is None:
            clear += use.secrets
        elif use.sealed_with not in held.ids:
            raise SecretKeyError(_missing(use.sealed_with, held.current))
    return clear


def rotate(conn: psycopg.Connection[DictRow], held: Keys) -> int:
    """Seal again, with the current key and bound to its row, every secret sealed otherwise,
    sealed unbound (Fernet, before issue 58) or in clear; the count.

    One row per statement, each checking the row still holds what was read (its text and key
    id), so a rotation running beside edits or a second rotation never overwrites a newer
    secret, and one interrupted anywhere is finished by running it again.
    """
    if not held.current:
        raise SecretKeyError(f"{KEY_SETTING} is not set: there is no key to seal with")
    current = held.current_id
    done = 0
    for row in conn.execute(Q.secrets_not_sealed_with, {"key_id": current, "bound": BOUND + "%"}).fetchall():
        place = Place(row["tbl"], row["owner"])
        plain = held.open(row["secret"], row["sealed_with"], place)
        stored, sealed_with = held.seal(plain, place)
        args = {"id": row["id"], "old": row["secret"], "new": stored, "key_id": sealed_with}
        query = Q.hook_secret_reseal if row["tbl"] == "hook_secrets" else Q.channel_secret_reseal
        with conn.transaction():
            done += conn.execute(query, args).rowcount
    return done
