"""Who may open the console, and what they may do there.

Every page needs an API token from `vigil tokens create`: ``Authorization: Bearer`` for
scripts, or, for a browser, the login form, which checks the token and keeps it in an
``HttpOnly; SameSite=Strict`` cookie (no script can read it, no other site's page can send
it). Actions (retries) are POSTs that carry a CSRF token derived from the session's token:
a form on another site cannot know it, and the server keeps no session state.

What a token may do is decided in one place, :func:`permits`, so that scoped tokens (the
hardening issue) are checked in one function: the console takes an ``admin`` token.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import StrEnum

from vigil.ingest.auth import MAX_TOKEN_CHARS, Caller, token_hash
from vigil.ingest.auth import permits as ingest_permits
from vigil.ledger.states import Scope

COOKIE = "vigil_console"
CSRF_FIELD = "csrf"


class Need(StrEnum):
    READ = "read"  # open any page
    WRITE = "write"  # retry a dead event, revive a dead delivery


@dataclass(frozen=True)
class Operator:
    """An authenticated console user: the token's id and name (never the token)."""

    token_id: str
    name: str
    csrf: str  # the value this session's forms must send back
    scopes: frozenset[str] | None = None  # the token's scopes (None: every scope, an old token)
    users: tuple[str, ...] | None = None  # the users it may act for (None: any)

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


def presented_token(authorization: str | None, cookie: str | None) -> str | None:
    """The token a request carries: a bearer header first, else the login cookie."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()[: MAX_TOKEN_CHARS + 1]
    if cookie:
        return cookie[: MAX_TOKEN_CHARS + 1]
    return None


def digest(token: str) -> str | None:
    """The ledger's key for a token (its sha256); None for what cannot be a token."""
    return None if len(token) > MAX_TOKEN_CHARS else token_hash(token)


def csrf_for(token: str) -> str:
    """A CSRF value bound to the session's token: HMAC(token, purpose). Only someone who holds
    the token can compute it, and the token sits in an HttpOnly cookie."""
    return hmac.new(token.encode(), b"vigil-console-csrf-v1", hashlib.sha256).hexdigest()


def csrf_ok(operator: Operator, sent: object) -> bool:
    return bool(sent) and hmac.compare_digest(operator.csrf, str(sent))
