"""Timers as callers create them: one validation for the HTTP API and `vigil timers`.

:func:`parse_timer` turns a request body into a :class:`NewTimer` or raises
:class:`InvalidTimer` naming the field and the reason (the API's 400, the CLI's error). The
store functions are :mod:`vigil.ledger.timers` (``ledger/queries/timers.sql``); the re-registration
rule lives in ``timer_upsert`` itself so that every writer gets it:

* a live timer keeps its stored due when that is later than the new one, because the stored
  due is already past every occurrence fired (a deploy re-running its set-up with the
  schedule's first due time changes nothing);
* a one-off that already fired (or was skipped) is not revived at or before that occurrence;
* a cancelled schedule revived with an old due is lifted past ``handled_through`` by the
  scheduler before it plans, so nothing fired before fires again;
* and should anything still replay an occurrence, its event key ``<id>@<scheduled_for>`` makes
  it a duplicate the ledger drops.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from vigil.envelope import id_problem
from vigil.errors import VigilError
from vigil.ledger.states import CatchUp, TimerKind

# The validated timer and its store live in the ledger (one door); re-exported here because
# callers create timers through this module: parse, then store.
from vigil.ledger.timers import NewTimer as NewTimer
from vigil.ledger.timers import TimerRow
from vigil.ledger.timers import upsert as upsert
from vigil.numbers import MAX_EPOCH, NotParsed, epoch_ceil, instant
from vigil.scheduler.timing import TimerSpec, next_occurrence, validate_cron, validate_tz

# Ids appear in URLs (DELETE .../timers/{id}) and in event keys (<id>@<epoch>).
TIMER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
# The payload is copied into every event the timer fires; events should stay small.
MAX_PAYLOAD_BYTES = 16 * 1024
MAX_SECONDS = 2**31 - 1  # every_seconds and max_lateness are integer columns
FIELDS = {"id", "due", "every", "cron", "tz", "catch_up", "max_lateness", "payload"}


class InvalidTimer(VigilError, ValueError):
    """A timer request that cannot be stored; ``field`` names the culprit."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


def parse_due(value: Any) -> int:
    """Epoch seconds or an RFC 3339 time with an offset -> whole epoch seconds
    (:func:`vigil.numbers.instant`, from 1970 to 9999).

    A fraction of a second rounds *up*: a timer never fires before the instant asked for.
    """
    try:
        epoch = epoch_ceil(instant(value, earliest=0, latest=MAX_EPOCH))
    except NotParsed as exc:
        raise InvalidTimer("due", str(exc)) from None
    if epoch > MAX_EPOCH:  # 9999-12-31T23:59:59.5Z rounds up past the last storable second
        raise InvalidTimer("due", "must lie between 1970-01-01 and 9999-12-31 UTC")
    return epoch


def _kind(value: Any) -> str:
    """A JSON value's kind in the words of JSON, not Python's type names."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, float):
        return "a fraction"
    kinds: dict[type, str] = {str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), "something else")


def _whole_seconds(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise InvalidTimer(name, f"expected a whole number of seconds, got {_kind(value)}")
    if not minimum <= value <= MAX_SECONDS:
        # The value is not echoed: it may be hundreds of digits long.
        raise InvalidTimer(name, f"must be between {minimum} and {MAX_SECONDS} seconds")
    return value


def _has_nul(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_timer(user_id: str, body: Any, now: int, min_every: int = 1) -> NewTimer:
    """Validate a create request (see the module docstring for the fields).

    ``due`` may be left out of a recurring timer: a cron schedule starts at its next match
    after ``now``, an interval one ``every`` seconds from ``now``. A one-off needs it.
    ``min_every`` is the API's floor for intervals (``VIGIL_MIN_TIMER_EVERY_S``).
    """
    problem = id_problem(user_id) if isinstance(user_id, str) else "must be a string"
    if problem is not None:
        raise InvalidTimer("user_id", problem)
    if not isinstance(body, dict):
        raise InvalidTimer("body", "expected a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidTimer(unknown[0], f"unknown field (known: {', '.join(sorted(FIELDS))})")
    timer_id = body.get("id")
    if not isinstance(timer_id, str) or not TIMER_ID.match(timer_id):
        raise InvalidTimer("id", "1 to 128 characters of letters, digits and . _ : -, starting with a letter or digit")
    every = _whole_seconds("every", body.get("every"), min_every)
    cron = body.get("cron")
    if every is not None and cron is not None:
        raise InvalidTimer("cron", "a timer recurs by every or by cron, not both")
    tz = body.get("tz", "UTC")
    try:
        validate_tz(tz)
    except ValueError as exc:
        raise InvalidTimer("tz", str(exc)) from None
    if cron is not None:
        if not isinstance(cron, str):
            raise InvalidTimer("cron", "expected a 5-field cron expression as a string")
        cron = " ".join(cron.split())
        try:
            validate_cron(cron, tz)
        except ValueError as exc:
            raise InvalidTimer("cron", str(exc)) from None
    catch_up = body.get("catch_up", CatchUp.COALESCE.value)
    if catch_up not in {c.value for c in CatchUp}:
        raise InvalidTimer("catch_up", f"expected one of {', '.join(c.value for c in CatchUp)}, got {catch_up!r}")
    max_lateness = _whole_seconds("max_lateness", body.get("max_lateness"), 0)
    payload = body.get("payload", {})
    if not isinstance(payload, dict):
        raise InvalidTimer("payload", "expected a JSON object")
    try:
        encoded = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode()
    except (ValueError, UnicodeEncodeError):
        raise InvalidTimer("payload", "must be valid JSON text (no lone surrogate, no NaN or Infinity)") from None
    if _has_nul(payload):
        raise InvalidTimer("payload", "must not contain NUL (the ledger's jsonb cannot hold one)")
    if len(encoded) > MAX_PAYLOAD_BYTES:
        raise InvalidTimer("payload", f"larger than {MAX_PAYLOAD_BYTES} bytes as JSON")
    due: int | None
    if body.get("due") is not None:
        due = parse_due(body["due"])
    elif cron is not None:
        due = next_occurrence(TimerSpec(due=now, cron=cron, tz=tz).recurrence, now)
        assert due is not None  # validate_cron proved a match within 50 years
    elif every is not None:
        due = now + every
    else:
        raise InvalidTimer("due", "required for a one-off timer (give every or cron to make it recur)")
    recurring = every is not None or cron is not None
    return NewTimer(
        user_id=user_id,
        id=timer_id,
        kind=TimerKind.SCHEDULE if recurring else TimerKind.FOLLOWUP,
        due=due,
        every=every,
        cron=cron,
        tz=tz,
        catch_up=CatchUp(catch_up),
        max_lateness=max_lateness,
        payload=payload,
    )


def _epoch(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def describe(row: TimerRow) -> dict[str, Any]:
    """A stored timer as the API and `vigil timers list --json` show it."""
    return {
        "id": row.id,
        "user_id": row.user_id,
        "kind": row.kind,
        "due": _epoch(row.due),
        "due_at": row.due.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "every": row.every_seconds,
        "cron": row.cron,
        "tz": row.tz,
        "catch_up": row.catch_up,
        "max_lateness": row.max_lateness,
        "payload": row.payload,
        "done": row.done,
        "skipped": row.skipped,
        "cancelled": row.cancelled_at is not None,
        "fired_count": row.fired_count,
        "last_fired_at": _epoch(row.last_fired_at),
        "error": row.error,
    }
