"""How `make suite` spreads tests over its xdist workers (docs/architecture.md, "Tests").

A module whose tests share one stack of processes (tests/test_secure_stack.py,
tests/test_every_port.py) carries an ``xdist_group`` mark so that one worker runs all of
its tests one after another and its module-scoped stack starts once. Nothing fails when the
mark stops working (pytest-xdist 3.8's loadgroup writes a node id field that pytest 9.2 no
longer reads: pytest-dev/pytest-xdist#1386); the stack just starts on every worker, and
again each time the worker comes back to the module after another's test. This runs the
installed pytest and pytest-xdist on two tiny modules to see that a group stays together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GROUPED = """
import os

import pytest

pytestmark = pytest.mark.xdist_group("shared")

SETUPS = []


@pytest.fixture(scope="module")
def shared_stack():
    SETUPS.append(1)
    return len(SETUPS)


@pytest.mark.parametrize("n", range(6))
def test_grouped(shared_stack, n):
    with open(os.environ["RAN_ON"], "a") as out:
        out.write(f"grouped {os.environ['PYTEST_XDIST_WORKER']} {shared_stack}\\n")
"""

LOOSE = """
import pytest


@pytest.mark.parametrize("n", range(6))
def test_loose(n):
    pass
"""


def test_an_xdist_group_runs_on_one_worker_and_sets_its_module_up_once(tmp_path: Path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_loose.py").write_text(LOOSE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repository's settings
    ran_on = tmp_path / "ran_on.txt"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "RAN_ON": str(ran_on)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    runs = [line.split() for line in ran_on.read_text().splitlines()]
    assert len(runs) == 6, runs
    workers = {worker for _, worker, _ in runs}
    assert len(workers) == 1, f"the group's tests ran on {sorted(workers)}"
    assert {setups for _, _, setups in runs} == {"1"}, f"the module-scoped fixture was set up again: {runs}"


def test_the_longest_tests_are_handed_out_first():
    """pytest-xdist hands tests out in collection order; a test of minutes handed out last
    would run alone at the phase's end while the other workers sit idle. The ones marked
    ``early`` come first (tests/conftest.py): the quick bench (minutes) and the few others
    over a minute under load."""
    repo = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", "not solo and not tools"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    assert len(ids) > 1000, result.stdout[-2000:]
    first = ids[:5]
    assert "tests/test_bench.py::test_quick_bench_prints_every_figure_and_cleans_up" in first, first
    assert "tests/test_ledger_model.py::test_the_ledger_keeps_its_promises" in first, first
