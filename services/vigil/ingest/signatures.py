"""Webhook signature schemes, verified on the raw body bytes in constant time.

Each verifier takes the request headers, the body exactly as received, and every active
secret of the hook (several during a rotation: a delivery signed with any of them passes).
It returns nothing or raises :class:`SignatureError` whose ``reason`` is one of a few fixed
words (a metric label) and whose ``detail`` is safe to return and log: it never contains a
secret, a signature or the body.

Why raw bytes: re-serialising parsed JSON changes whitespace and key order, so the HMAC
would not match; and why before anything is produced: otherwise anyone who can reach the
endpoint could write events, or take a provider's delivery id before the real delivery.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence

from vigil.errors import VigilError
from vigil.ledger.states import HookProvider
from vigil.numbers import MAX_EPOCH, NotParsed, whole_number

# A real delivery carries one to a handful of signatures; more is an attempt to make us
# compute comparisons for free.
MAX_SIGNATURES = 16
STANDARD_SECRET_PREFIX = "whsec_"


class SignatureError(VigilError):
    MISSING = "missing_header"
    MALFORMED = "malformed_header"
    STALE = "stale_timestamp"
    MISMATCH = "bad_signature"

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _hmac_sha256(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def _any_matches(expected: list[bytes], given: list[bytes]) -> bool:
    # Every comparison runs (no early exit), each in constant time for its length.
    matched = False
    for mine in expected:
        for theirs in given:
            matched |= hmac.compare_digest(mine, theirs)
    return matched


def _header(headers: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = headers.get(name)
        if value:
            return value.strip()
    raise SignatureError(SignatureError.MISSING, f"missing header {names[0]}")


def _timestamp(value: str, header: str, now: float, tolerance: int) -> str:
    try:
        stamp = whole_number(value, 0, MAX_EPOCH)  # ASCII digits: "²" (byte B2 as latin-1) is not one
    except NotParsed:
        raise SignatureError(SignatureError.MALFORMED, f"{header} is not a Unix timestamp") from None
    if abs(now - stamp) > tolerance:
        raise SignatureError(SignatureError.STALE, f"{header} is more than {tolerance}s from now")
    return value


def verify_github(headers: Mapping[str, str], body: bytes, secrets: Sequence[str], now: float, tolerance: int) -> None:
    """``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>``. GitHub signs no
    timestamp: a replay is caught by the dedup key (``X-GitHub-Delivery``) instead."""
    value = _header(headers, "x-hub-signature-256")
    scheme, _, digest = value.partition("=")
    if scheme != "sha256" or not digest:
        raise SignatureError(SignatureError.MALFORMED, "X-Hub-Signature-256 is not sha256=<hex>")
    expected = [_hmac_sha256(secret.encode(), body).hex().encode() for secret in secrets]
    if not _any_matches(expected, [digest.lower().encode("latin-1")]):
        raise SignatureError(SignatureError.MISMATCH, "X-Hub-Signature-256 does not match the body")


def verify_stripe(headers: Mapping[str, str], body: bytes, secrets: Sequence[str], now: float, tolerance: int) -> None:
    """``Stripe-Signature: t=<unix>,v1=<hex>[,v1=<hex>...]`` over ``<t>.<body>``, keyed
    with the endpoint secret as issued (``whsec_...``, used as-is)."""
    value = _header(headers, "stripe-signature")
    stamp: str | None = None
    given: list[bytes] = []
    for item in value.split(",")[: MAX_SIGNATURES + 4]:
        key, _, val = item.strip().partition("=")
        if key == "t":
            stamp = val
        elif key == "v1" and val:
            given.append(val.lower().encode("latin-1"))
    if stamp is None or not given:
        raise SignatureError(SignatureError.MALFORMED, "Stripe-Signature lacks t= or v1=")
    stamp = _timestamp(stamp, "Stripe-Signature t", now, tolerance)
    expected = [_hmac_sha256(secret.encode(), stamp.encode(), b".", body).hex().encode() for secret in secrets]
    if not _any_matches(expected, given[:MAX_SIGNATURES]):
        raise SignatureError(SignatureError.MISMATCH, "no v1 signature in Stripe-Signature matches")


def standard_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: base64 after the ``whsec_`` prefix."""
    encoded = secret[len(STANDARD_SECRET_PREFIX) :] if secret.startswith(STANDARD_SECRET_PREFIX) else secret
    return base64.b64decode(encoded, validate=True)


def _standard_keys(secrets: Sequence[str]) -> list[bytes]:
    keys = []
    for secret in secrets:
        try:
            keys.append(standard_key(secret))
        except (binascii.Error, ValueError):
            continue  # refused at `vigil hooks add`; an edited row must not crash requests
    return keys


def verify_standard(
    headers: Mapping[str, str], body: bytes, secrets: Sequence[str], now: float, tolerance: int
) -> None:
    """Standard Webhooks: ``webhook-signature: v1,<base64 HMAC-SHA256> ...`` (space
    separated) over ``<webhook-id>.<webhook-timestamp>.<body>``. Svix's ``svix-*`` header
    names are the same scheme and accepted too."""
    msg_id = _header(headers, "webhook-id", "svix-id")
    stamp = _timestamp(_header(headers, "webhook-timestamp", "svix-timestamp"), "webhook-timestamp", now, tolerance)
    value = _header(headers, "webhook-signature", "svix-signature")
    given = []
    for item in value.split(" ")[:MAX_SIGNATURES]:
        version, _, signature = item.partition(",")
        if version == "v1" and signature:  # v1a (asymmetric) is not used by vigil's hooks
            given.append(signature.encode("latin-1"))
    if not given:
        raise SignatureError(SignatureError.MALFORMED, "webhook-signature has no v1 signature")
    # Header values arrive decoded as latin-1; encoding back gives the bytes that were signed.
    signed = (msg_id.encode("latin-1"), b".", stamp.encode(), b".", body)
    expected = [base64.b64encode(_hmac_sha256(key, *signed)) for key in _standard_keys(secrets)]
    if not _any_matches(expected, given):
        raise SignatureError(SignatureError.MISMATCH, "no v1 signature in webhook-signature matches")


Verifier = Callable[[Mapping[str, str], bytes, Sequence[str], float, int], None]

VERIFIERS: dict[HookProvider, Verifier] = {
    HookProvider.GITHUB: verify_github,
    HookProvider.STRIPE: verify_stripe,
    HookProvider.STANDARD_WEBHOOKS: verify_standard,
}


def valid_standard_secret(secret: str) -> bool:
    try:
        return secret.startswith(STANDARD_SECRET_PREFIX) and len(standard_key(secret)) >= 16
    except (binascii.Error, ValueError):
        return False
