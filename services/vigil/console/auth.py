"""Who may open the console, and what they may do there.

Every page needs an API token from `vigil tokens create`, one that may use the console
(:func:`permits`):

- scripts send ``Authorization: Bearer <token>``. A request with an ``Authorization`` header
  is judged by that header alone: a cookie beside it is ignored, so no header (an empty
  ``Bearer``, another scheme) can turn a cookie's request into one that skips the CSRF check;
- a browser logs in once through the form, which makes a server-side session (ledger table
  ``console_sessions``): the cookie holds a random session id, never the token, and expires
  (``Max-Age`` and the session's ``expires_at``, ``VIGIL_CONSOLE_SESSION_S``); logout ends the
  session in the ledger. Each session has a random CSRF value that its forms send back,
  logout's included; the login form itself is protected by a double-submit value (a cookie
  set with the form, sent back in it) that this console issued and signed
  (:func:`new_login_csrf`): a pair the client made up, equal or not, is refused.

What a token may do is decided in one place, :func:`permits`: the console takes an ``admin``
token for every user.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from enum import StrEnum

from vigil.ingest.auth import MAX_TOKEN_CHARS, Caller, token_hash
from vigil.ingest.auth import permits as ingest_permits
from vigil.ledger.ingest import AuthToken
from vigil.ledger.states import Scope

COOKIE = "vigil_console"  # the session id
LOGIN_COOKIE = "vigil_console_login"  # the login form's double-submit CSRF value
CSRF_FIELD = "csrf"
SESSION_ID_BYTES = 32
# A browser's cookie is our own session id (43 characters) or nothing we issued.
MAX_SESSION_ID_CHARS = 64


class Need(StrEnum):
    READ = "read"  # open any page
    WRITE = "write"  # retry a dead event, revive a dead delivery


@dataclass(frozen=True)
class Operator:
    """An authenticated console user: the token's id and name (never the token)."""

    token_id: str
    name: str
    csrf: str = ""  # the value this session's forms must send back ("": a bearer, no session)
    scopes: frozenset[str] | None = None  # the token's scopes (None: every scope, an old token)
    users: tuple[str, ...] | None = None  # the users it may act for (None: any)
    session: str | None = None  # the session's id hash (None: a bearer header)

    @property
    def actor(self) -> str:
        """How the audit table names them: the token's name and id, and where they acted."""
        return f"{self.name} ({self.token_id}) via console"


def permits(operator: Operator, need: Need) -> bool:
    """The one authorization check: the console shows every user's work and acts on it, so it
    takes an operator token, one with the ``admin`` scope (:func:`vigil.ingest.auth.permits`)
    and no restriction to some users. Reading and retrying need the same today; ``need`` is
    where a read-only operator scope would go."""
    caller = Caller(operator.token_id, operator.name, operator.scopes, operator.users)
    return operator.users is None and ingest_permits(caller, Scope.ADMIN)


def may_log_in(row: AuthToken) -> bool:
    """Whether a token gets a session at all: one that may open pages."""
    scopes = None if row.scopes is None else frozenset(row.scopes)
    users = None if row.users is None else tuple(row.users)
    return permits(Operator(row.id, row.name, scopes=scopes, users=users), Need.READ)


def bearer(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None for anything else."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token[: MAX_TOKEN_CHARS + 1]


def digest(token: str) -> str | None:
    """The ledger's key for a token (its sha256); None for what cannot be a token."""
    return None if len(token) > MAX_TOKEN_CHARS else token_hash(token)


def new_session_id() -> str:
    return secrets.token_urlsafe(SESSION_ID_BYTES)


def session_hash(cookie: str) -> str | None:
    """The ledger's key for a session cookie (its sha256); None for what we never issued."""
    if not cookie or len(cookie) > MAX_SESSION_ID_CHARS:
        return None
    return hashlib.sha256(cookie.encode()).hexdigest()


def new_csrf() -> str:
    """A session's (or the login form's) CSRF value: random, nothing an attacker can derive."""
    return secrets.token_hex(32)


def login_key(secret: str | None) -> bytes:
    """The key that signs login forms' CSRF values: derived from ``VIGIL_SECRET_KEY`` when it
    is set (every console replica then accepts the others' forms), else random per process
    (a form from another replica, or from before a restart, asks to log in again)."""
    if secret is None:
        return secrets.token_bytes(32)
    return hashlib.sha256(b"vigil console login csrf\x00" + secret.encode()).digest()


def _login_mac(key: bytes, issued: str) -> str:
    return hmac.new(key, f"login-csrf:{issued}".encode(), hashlib.sha256).hexdigest()


def new_login_csrf(key: bytes, now: float) -> str:
    """The login form's CSRF value: ``<issued unix seconds>.<random>.<HMAC>``, issued here."""
    issued = f"{int(now)}.{secrets.token_hex(16)}"
    return f"{issued}.{_login_mac(key, issued)}"


def login_csrf_ok(key: bytes, cookie: str | None, sent: object, now: float, lifetime_s: int) -> bool:
    """The form sent back the cookie's value, and this console issued it within ``lifetime_s``
    (issue 58: any equal pair the client made up passed the double-submit check)."""
    if not same(cookie, sent):
        return False
    issued, _, mac = str(cookie).rpartition(".")
    at, _, nonce = issued.partition(".")
    if not (at.isascii() and at.isdigit() and len(at) <= 12 and nonce):
        return False
    return hmac.compare_digest(mac.encode(), _login_mac(key, issued).encode()) and 0 <= now - int(at) <= lifetime_s


def same(expected: str | None, sent: object) -> bool:
    """A CSRF comparison: both present and equal, in constant time."""
    return bool(expected) and bool(sent) and hmac.compare_digest(str(expected).encode(), str(sent).encode())
