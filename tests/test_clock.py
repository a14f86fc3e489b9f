"""The one clock (services/vigil/clock.py): one unit, tests move it, no service keeps its own."""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path

from vigil.clock import FileClock, ManualClock, SystemClock, utc, write_clock_file

SERVICES = Path(__file__).resolve().parent.parent / "services"


def test_a_manual_clock_moves_wall_time_and_intervals_together():
    clock = ManualClock(1_000.0)
    assert (clock.now(), clock.monotonic()) == (1_000.0, 1_000.0)
    assert clock.advance(2.5) == 1_002.5
    assert (clock.now(), clock.monotonic()) == (1_002.5, 1_002.5)
    clock.set(50)
    assert isinstance(clock.now(), float) and clock.now() == 50.0


def test_the_system_clock_reads_epoch_seconds():
    assert abs(SystemClock().now() - datetime.now(UTC).timestamp()) < 5


def test_a_file_clock_follows_its_file_and_keeps_the_last_value_through_a_bad_read(tmp_path):
    path = tmp_path / "clock"
    write_clock_file(path, 1_700_000_000.25)
    clock = FileClock(path)
    assert clock.now() == 1_700_000_000.25
    write_clock_file(path, 1_700_000_060.0)
    assert clock.now() == 1_700_000_060.0
    path.write_text("")  # caught mid-rewrite
    assert clock.now() == 1_700_000_060.0


def test_utc_is_the_same_instant_as_a_datetime():
    at = datetime(2026, 3, 2, 9, 0, 0, 500_000, tzinfo=UTC)
    assert utc(at.timestamp()) == at


def test_no_service_defines_its_own_clock():
    """Time read two ways (a scheduler clock in seconds, a dispatcher clock in datetimes) is
    what issue 19 removed: a second Clock class anywhere in the product brings it back."""
    clocks = []
    for path in (SERVICES / "vigil").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Clock"):
                clocks.append(f"{path.relative_to(SERVICES)}:{node.name}")
    assert sorted(clocks) == [f"vigil/clock.py:{name}" for name in ("Clock", "FileClock", "ManualClock", "SystemClock")]
