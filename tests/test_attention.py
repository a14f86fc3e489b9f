"""Attention earned: each user's gap adapts to whether they answer, on the real dispatcher.

Every new delivery looks back at the one before it: a chat message from the person within
VIGIL_ATTENTION_REPLY_WINDOW_S halves the gap, none doubles it, within the bounds, starting
at the quiet end. An operator can pin it; a channel's own gap still wins. Metrics: reply
rate and deliveries per user per day, neither with a user label.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from dispatcher_support import T0, add_message, add_users, in_process_dispatcher, one_pass, sample
from support import scalar
from vigil.clock import ManualClock, utc
from vigil.dispatcher.operator import set_attention, show_user
from vigil.ledger import db

ROOT = Path(__file__).resolve().parents[1]
MIN, MAX, WINDOW = 300, 3600, 1800


@pytest.fixture
def dispatch(ledger):
    made = []

    def make(clock, **overrides):
        settings = {
            "outbox_gap": 60,
            "attention_adapt": True,
            "attention_min_gap_s": MIN,
            "attention_max_gap_s": MAX,
            "attention_reply_window_s": WINDOW,
            **overrides,
        }
        d = in_process_dispatcher(ledger, clock, **settings)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def at(clock: ManualClock, seconds: float):
    clock.set((T0 + timedelta(seconds=seconds)).timestamp())
    return utc(clock.now())


def reply(dsn: str, user: str, when) -> None:
    """A chat message from the person, as ingest and the worker record it."""
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO events (user_id, source, source_id, kind, payload, received_at)"
            " VALUES (%s, 'chat', gen_random_uuid()::text, 'chat.message', '{}', %s)",
            (user, when),
        )


def deliver(ledger, d, clock, user: str, seconds: float) -> int:
    add_message(ledger, user, f"note at {seconds}", created_at=at(clock, seconds))
    return one_pass(d)


def gap(ledger, user: str) -> tuple[int | None, str | None]:
    with psycopg.connect(ledger) as conn:
        row = conn.execute("SELECT attention_gap_s, attention_reason FROM users WHERE user_id = %s", (user,)).fetchone()
    assert row is not None
    return row[0], row[1]


def test_gap_starts_quiet_shrinks_with_replies_and_grows_when_ignored(ledger, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock)
    add_users(ledger, ["ana"])
    replied, unanswered = (
        sample("vigil_attention_outcomes_total", {"outcome": "replied"}),
        sample("vigil_attention_outcomes_total", {"outcome": "unanswered"}),
    )

    assert deliver(ledger, d, clock, "ana", 0) == 1
    assert gap(ledger, "ana") == (MAX, "start: the quiet end")
    # The quiet end holds the next message for the whole hour, not VIGIL_OUTBOX_GAP's minute.
    assert deliver(ledger, d, clock, "ana", 120) == 0
    reply(ledger, "ana", at(clock, 600))  # answered within the window
    assert one_pass(d) == 0
    at(clock, MAX)
    assert one_pass(d) == 1
    assert gap(ledger, "ana") == (MAX // 2, "replied within the window: halved")

    t, expected = MAX, MAX // 2
    for _ in range(3):  # 1800 -> 900 -> 450 -> 300, never below the lower bound
        reply(ledger, "ana", at(clock, t + 60))
        t += expected
        assert deliver(ledger, d, clock, "ana", t) == 1
        expected = max(MIN, expected // 2)
        assert gap(ledger, "ana")[0] == expected
    assert expected == MIN

    # Ignored: a reply after the window does not count; the gap doubles.
    reply(ledger, "ana", at(clock, t + WINDOW + 5))
    t += WINDOW + 10
    assert deliver(ledger, d, clock, "ana", t) == 1
    assert gap(ledger, "ana") == (2 * MIN, "previous message unanswered: doubled")
    assert sample("vigil_attention_outcomes_total", {"outcome": "replied"}) == replied + 4
    assert sample("vigil_attention_outcomes_total", {"outcome": "unanswered"}) == unanswered + 1


def test_adapting_off_keeps_the_configured_gap(ledger, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, attention_adapt=False)
    add_users(ledger, ["bo"])
    assert deliver(ledger, d, clock, "bo", 0) == 1
    assert gap(ledger, "bo") == (None, None)
    assert deliver(ledger, d, clock, "bo", 61) == 1  # VIGIL_OUTBOX_GAP (60 s), as before


def test_an_operator_pin_stops_adapting_and_auto_resumes(ledger, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock)
    add_users(ledger, ["cy"])
    deliver(ledger, d, clock, "cy", 0)
    with db.connect(ledger, autocommit=True) as conn:
        assert set_attention(conn, "cy", 120, actor="ops")
        shown = show_user(conn, "cy", 60)
        assert not set_attention(conn, "nobody", 120, actor="ops")
    assert shown is not None
    assert (shown["gap_seconds"], shown["gap_source"], shown["reason"]) == (120, "pinned", "pinned by ops")
    assert scalar(ledger, "SELECT count(*) FROM audit WHERE action = 'user.attention'") == 1
    assert deliver(ledger, d, clock, "cy", 121) == 1  # the pinned gap applies ...
    assert gap(ledger, "cy")[0] == 120  # ... and an unanswered message does not move it
    with db.connect(ledger, autocommit=True) as conn:
        set_attention(conn, "cy", None, actor="ops")
    assert deliver(ledger, d, clock, "cy", 242) == 1
    assert gap(ledger, "cy") == (MIN, "previous message unanswered: doubled")  # 240, back within bounds


def test_deliveries_per_user_day_is_observed_when_the_day_turns(ledger, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock, attention_adapt=False)
    add_users(ledger, ["di"])
    before = sample("vigil_deliveries_per_user_day_count")
    for n in range(3):
        deliver(ledger, d, clock, "di", n * 61)
    assert sample("vigil_deliveries_per_user_day_count") == before
    deliver(ledger, d, clock, "di", 86_400)
    assert sample("vigil_deliveries_per_user_day_count") == before + 1
    assert sample("vigil_deliveries_per_user_day_bucket", {"le": "3.0"}) >= 1


def test_cli_shows_and_overrides_the_gap(ledger, dispatch):
    clock = ManualClock(T0.timestamp())
    d = dispatch(clock)
    add_users(ledger, ["eve"])
    deliver(ledger, d, clock, "eve", 0)
    env = {**os.environ, "VIGIL_DATABASE_URL": ledger, "PYTHONPATH": str(ROOT / "services")}

    def vigil(*args):
        return subprocess.run([sys.executable, "-m", "vigil", *args], env=env, capture_output=True, text=True)

    shown = vigil("users", "show", "eve", "--json")
    assert shown.returncode == 0, shown.stderr
    body = json.loads(shown.stdout)
    assert (body["gap_seconds"], body["gap_source"], body["reason"]) == (MAX, "earned", "start: the quiet end")
    pinned = vigil("users", "attention", "eve", "--gap", "900")
    assert pinned.returncode == 0 and "gap 900s (pinned" in pinned.stdout, pinned.stderr
    assert vigil("users", "attention", "eve", "--gap", "auto").returncode == 0
    assert json.loads(vigil("users", "show", "eve", "--json").stdout)["gap_source"] == "earned"
    missing = vigil("users", "show", "nobody")
    assert missing.returncode != 0 and "no user 'nobody'" in missing.stderr


def test_console_user_page_shows_the_earned_gap(ledger, dispatch):
    from starlette.testclient import TestClient

    from test_console_pages import HTML, login
    from vigil.console.app import create_app
    from vigil.console.settings import ConsoleSettings

    clock = ManualClock(T0.timestamp())
    d = dispatch(clock)
    add_users(ledger, ["fay"])
    deliver(ledger, d, clock, "fay", 0)
    app = create_app(ConsoleSettings(database_url=ledger, console_auth_cache_s=0))
    with TestClient(app, base_url="http://console.test", follow_redirects=False) as console:
        login(console, ledger)
        page = console.get("/users/fay", headers=HTML).text
    assert f"attention gap {MAX}s (start: the quiet end)" in page


def test_bounds_the_wrong_way_round_refuse_to_start(ledger):
    from pydantic import ValidationError

    from vigil.dispatcher.settings import DispatcherSettings

    with pytest.raises(ValidationError, match="VIGIL_ATTENTION_MIN_GAP_S must be at most"):
        DispatcherSettings(database_url=ledger, attention_min_gap_s=600, attention_max_gap_s=300)
