"""Numbers and instants from outside vigil, parsed once, strictly.

Every edge that takes a whole number or an instant from a client parses it here (query
strings, headers, JSON fields, `vigil timers add`), so they agree on what is accepted and
refuse it in the same neutral words. Python's own conversions are too lenient and too
talkative for an edge: ``int()`` takes ``²``, ``١٢``, `` 5 `` and ``1_0``, refuses 5,000 digits
with advice about ``sys.set_int_max_str_digits``, and ``float()`` turns ``1e-400`` into 0.0.

* **Whole numbers in text** (:func:`whole_number`): ASCII digits only, at most
  :data:`MAX_DIGITS` of them; no sign, space, underscore or other digit characters.
* **Decimal numbers in text** (:func:`decimal_number`, seconds at the operator CLI): the
  same, with an optional fraction.
* **Number literals in JSON** (:func:`json_int`, :func:`json_float`, the hooks of ingest's
  JSON decoder): at most :data:`MAX_LITERAL_CHARS` characters, finite, and not so small that
  they would be stored as 0.
* **Instants** (:func:`instant`): an RFC 3339 time with an offset
  (``2026-03-08T09:00:00Z``, ``...+09:00``), or a bare number meaning Unix seconds (a JSON
  number, or a string of ASCII digits with an optional fraction; never milliseconds). Both
  forms have the same bounds: years 1 to 9999 in UTC unless the caller narrows them.
* **Unix seconds as a JSON integer** (:func:`unix_seconds`, Stripe's ``created``).
* **An event's own instants** (:func:`event_instant_problem`): ``occurred_at`` and
  ``received_at`` from 1970 to a day past the moment they are judged, whoever produced them.

A refusal is :class:`NotParsed` (a ``ValueError``) whose text is safe to show and to log:
it never echoes a long input. Callers name their field: ``invalid("due", str(exc))``.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from vigil.errors import VigilError

MAX_DIGITS = 19  # whole numbers in text: anything longer is out of every range vigil has
MAX_LITERAL_CHARS = 1000  # a JSON number literal (digits, sign, point, exponent)
MIN_EPOCH = -62_135_596_800  # 0001-01-01T00:00:00Z, the first instant of RFC 3339
MAX_EPOCH = 253_402_300_799  # 9999-12-31T23:59:59Z, the last whole second RFC 3339 can write
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
EXAMPLE = "2026-03-08T09:00:00Z"

_DIGITS = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}")
_DECIMAL = re.compile(r"(-?)([0-9]+)(?:\.([0-9]+))?")
_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))?"
)
_SECOND = timedelta(seconds=1)
# A producer's clock may run a little fast; an event stamped more than a day ahead (or the
# year 9999, or the year 1) is a bug or a forgery, and would sort first or last in every
# timeline ordered by it.
EVENT_AHEAD = timedelta(days=1)


class NotParsed(VigilError, ValueError):
    """A number or instant that is refused; the text says why in words safe to show."""


def whole_number(text: str, low: int, high: int) -> int:
    """``text`` as a whole number from ``low`` to ``high`` (ASCII digits only, no sign)."""
    if not _DIGITS.fullmatch(text) or not low <= int(text) <= high:
        raise NotParsed(f"expected a whole number from {low} to {high}")
    return int(text)


def decimal_number(text: str, low: float, high: float) -> float:
    """``text`` as a number from ``low`` to ``high``: ASCII digits with an optional fraction
    (``2.5``); no sign, exponent, ``nan`` or ``inf``, which ``float()`` takes."""
    match = _DECIMAL.fullmatch(text)
    if match is None or match[1] or len(match[2]) > MAX_DIGITS or not low <= float(text) <= high:
        raise NotParsed(f"expected a number from {low:g} to {high:g}")
    return float(text)


# -- JSON number literals ----------------------------------------------------------------


def json_int(text: str) -> int:
    """An integer literal of a JSON document (``parse_int`` of the decoder)."""
    if len(text) > MAX_LITERAL_CHARS:
        raise NotParsed(f"a number has more than {MAX_LITERAL_CHARS} digits")
    return int(text)


def json_float(text: str) -> float:
    """A literal with a fraction or exponent (``parse_float``): finite, and not one that
    would be stored as 0 (``1e-400``); the payload is re-encoded from the parsed value."""
    if len(text) > MAX_LITERAL_CHARS:
        raise NotParsed(f"a number has more than {MAX_LITERAL_CHARS} characters")
    value = float(text)
    shown = text if len(text) <= 24 else text[:20] + "..."
    if not math.isfinite(value):  # 1e999: would be stored as the text Infinity
        raise NotParsed(f"the number {shown} is too large to store")
    if value == 0.0 and any(c in "123456789" for c in text.lower().partition("e")[0]):
        raise NotParsed(f"the number {shown} is too small to store (it would become 0)")
    return value


def json_constant(name: str) -> None:
    """``parse_constant``: Python's json accepts NaN and Infinity; other consumers would not."""
    raise NotParsed(f"{name} is not valid JSON")


# -- instants ----------------------------------------------------------------------------


def _day(epoch: int) -> str:
    return (EPOCH + timedelta(seconds=epoch)).date().isoformat()


def _bounds(earliest: int, latest: int) -> str:
    return f"must lie between {_day(earliest)} and {_day(latest)} UTC"


def _from_micros(micros: int, earliest: int, latest: int) -> datetime:
    # Whole microseconds as an int: a 400-digit number is compared, never made a float.
    if not earliest * 1_000_000 <= micros < (latest + 1) * 1_000_000:
        raise NotParsed(_bounds(earliest, latest))
    return EPOCH + timedelta(microseconds=micros)


def _micros(text: str) -> int:
    return int(text[:6].ljust(6, "0"))


def instant(value: Any, *, earliest: int = MIN_EPOCH, latest: int = MAX_EPOCH) -> datetime:
    """An RFC 3339 time with an offset, or Unix seconds, as an aware datetime from ``earliest``
    to ``latest`` (Unix seconds, inclusive; a fraction of ``latest``'s second passes, as
    ``9999-12-31T23:59:59.5Z`` does).

    A bare number always means seconds (1767225600000 is the year 57970, not 2026). An RFC
    3339 time keeps its offset; a number is in UTC. Fractions past microseconds are dropped.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise NotParsed(f"expected epoch seconds or an RFC 3339 time such as {EXAMPLE}")
    if isinstance(value, int):
        return _from_micros(value * 1_000_000, earliest, latest)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotParsed(_bounds(earliest, latest))
        whole = math.floor(value)
        return _from_micros(whole * 1_000_000 + round((value - whole) * 1_000_000), earliest, latest)
    number = _DECIMAL.fullmatch(value)
    if number is not None:
        sign, whole_text, fraction = number.groups()
        if len(whole_text.lstrip("0")) > 12:  # past year 9999 whatever its fraction; no huge int()
            raise NotParsed(_bounds(earliest, latest))
        micros = int(whole_text) * 1_000_000 + _micros(fraction or "")
        return _from_micros(-micros if sign else micros, earliest, latest)
    match = _RFC3339.fullmatch(value)
    if match is None:
        raise NotParsed(f"neither epoch seconds nor an RFC 3339 time (such as {EXAMPLE})")
    year, month, day, hour, minute, second, fraction, zulu, sign, off_h, off_m = match.groups()
    if zulu is None and sign is None:
        raise NotParsed("has no UTC offset: add Z or +hh:mm (a bare local time is ambiguous)")
    try:
        if sign and int(off_m) > 59:
            raise ValueError("offset minutes")
        offset = timedelta(hours=int(off_h), minutes=int(off_m)) * (-1 if sign == "-" else 1) if sign else timedelta()
        moment = datetime(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            _micros(fraction or ""),
            tzinfo=UTC if zulu else timezone(offset),
        )
    except ValueError:
        raise NotParsed(f"is not a valid date, time or offset (RFC 3339, such as {EXAMPLE})") from None
    # Subtracting aware datetimes never builds the UTC one, which may be in year 0 or 10000.
    if not earliest <= (moment - EPOCH) // _SECOND <= latest:
        raise NotParsed(_bounds(earliest, latest))
    return moment


def epoch_ceil(moment: datetime) -> int:
    """Whole Unix seconds at or after ``moment`` (exact: no float on the way)."""
    whole, rest = divmod(moment - EPOCH, _SECOND)
    return whole + (1 if rest else 0)


def unix_seconds(value: Any, *, earliest: int = 0, latest: int = MAX_EPOCH) -> datetime:
    """A JSON integer of Unix seconds (Stripe's ``created``): not a bool, float or string."""
    if isinstance(value, bool) or not isinstance(value, int) or not earliest <= value <= latest:
        raise NotParsed(f"must be a whole number of Unix seconds from {_day(earliest)} to {_day(latest)}")
    return EPOCH + timedelta(seconds=value)


# -- an event's own instants -------------------------------------------------------------


def event_instant_problem(value: datetime, now: datetime) -> str | None:
    """Why ``value`` cannot be an event's ``occurred_at`` or ``received_at`` at ``now``, or None.

    From the Unix epoch to :data:`EVENT_AHEAD` past ``now``: ingest refuses an instant outside
    with a 400, the worker dead-letters an event produced straight to Kafka with one.
    """
    if value < EPOCH:
        return "is before 1970-01-01T00:00:00Z"
    if value > now + EVENT_AHEAD:
        return "is more than a day ahead of now"
    return None
