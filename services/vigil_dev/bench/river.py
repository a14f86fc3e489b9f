"""The peer: River (a PostgreSQL job queue in Go) measured in the same run as vigil's figures.

- ``peer_river_jobs_per_s``: River's own benchmark, ``river bench --duration``, against a
  database of its own on the bench's PostgreSQL (created, ``river migrate-up``, dropped at the
  end), with ``synchronous_commit=on`` set on that database, so its commits wait for the WAL
  flush like vigil's ledger sessions. River inserts jobs and works them in one process; the
  figure is its closing ``overall job/sec`` (jobs worked over the round), one round per
  ``plan.rounds``. A job is River's unit of work, the closest thing it has to a single-event
  run: the summary divides ``e2e_events_per_s`` and ``e2e_single_event_runs_per_s`` by it.

River's CLI is built from its Go module once per machine (``deploy/tools/build-river.sh``:
the version and every module's hash pinned in ``deploy/tools/river/``). A machine that cannot
build it (no Go) prints the figure as pending with the reason, and the bench does not fail
for it; ``--quick`` skips it.
"""

from __future__ import annotations

import re
import subprocess
import urllib.parse

import psycopg

from vigil.paths import repo_root
from vigil_dev.bench.figures import Figure, Report, fmt
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.stack import BenchStack

FIGURES = ["peer_river_jobs_per_s"]
# Issue 55's targets: vigil's figure over River's jobs per second, both from the same run.
TARGETS = {
    "e2e_events_per_s": ("e2e_vs_river", 0.75),
    "e2e_single_event_runs_per_s": ("single_event_runs_vs_river", 0.30),
}
BUILD = repo_root() / "deploy" / "tools" / "build-river.sh"
BUILD_TIMEOUT_S = 1200.0  # a first build on a fresh 2-core machine downloads and compiles for minutes
MIGRATE_TIMEOUT_S = 120.0
# River's closing line: "bench: total jobs worked [ N ], total jobs inserted [ M ], overall job/sec [ R ], running Ds"
OVERALL = re.compile(r"total jobs worked \[\s*(\d+)\s*\].*overall job/sec \[\s*([0-9.]+)\s*\]")


class RiverUnavailable(RuntimeError):
    """River's CLI could not be built on this machine."""


def build() -> str:
    """The path of River's CLI, built first if this machine has none yet."""
    try:
        done = subprocess.run(
            ["bash", str(BUILD)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RiverUnavailable(f"{BUILD.name}: {exc}") from exc
    if done.returncode != 0 or not done.stdout.strip():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RiverUnavailable(f"{BUILD.name} exited {done.returncode}: {last}"[:200])
    return done.stdout.strip().splitlines()[-1]


def url(conninfo: str) -> str:
    """A ``postgresql://`` URL for a libpq connection string: River's CLI takes only URLs (it
    picks its driver by the scheme); the other parameters (sslmode, ...) go as its query."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    user = urllib.parse.quote(str(params.pop("user", "")), safe="")
    password = params.pop("password", None)
    auth = f"{user}@" if user else ""
    if password is not None:
        auth = f"{user}:{urllib.parse.quote(str(password), safe='')}@"
    host = str(params.pop("host", "127.0.0.1"))
    port = params.pop("port", None)
    database = urllib.parse.quote(str(params.pop("dbname", "")), safe="")
    netloc = f"{auth}{host}" + (f":{port}" if port else "")
    query = urllib.parse.urlencode({k: str(v) for k, v in params.items()})
    return f"postgresql://{netloc}/{database}" + (f"?{query}" if query else "")


def river(stack: BenchStack, plan: Plan, report: Report) -> None:
    if plan.river_seconds <= 0:
        report.say(f"river: skipped in --{plan.name} (peer_river_jobs_per_s and its ratios: `make bench`)")
        return
    try:
        binary = build()
    except RiverUnavailable as exc:
        report.add(Figure(FIGURES[0], pending=f"River's CLI not built: {exc}", counted=False))
        return
    with stack.database("river") as dsn:
        with psycopg.connect(stack.admin_dsn, autocommit=True) as conn:
            # Every session of River's then commits as vigil's ledger sessions do.
            name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
            conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = on')
        with psycopg.connect(dsn, autocommit=True) as conn:
            if conn.execute("SHOW synchronous_commit").fetchone()[0] != "on":  # type: ignore[index]
                raise RuntimeError("River's database did not take synchronous_commit = on")
        target = url(dsn)
        secret = psycopg.conninfo.conninfo_to_dict(dsn).get("password")
        _river(binary, ["migrate-up", "--database-url", target], MIGRATE_TIMEOUT_S, secret)
        samples, worked = [], []
        for _ in range(plan.rounds):
            out = _river(
                binary,
                ["bench", "--database-url", target, "--duration", f"{plan.river_seconds:g}s"],
                plan.river_seconds + MIGRATE_TIMEOUT_S,
                secret,
            )
            found = OVERALL.search(out)
            if not found:
                raise RuntimeError(f"river bench printed no overall job/sec: {out.strip()[-300:]}")
            worked.append(int(found.group(1)))
            samples.append(float(found.group(2)))
    version = binary.rsplit("/", 2)[-2].removeprefix("river-")
    note = f"River {version}, `river bench --duration {plan.river_seconds:g}s`, {min(worked)}-{max(worked)} jobs worked"
    report.add(Figure(FIGURES[0], samples, note=note))


def _river(binary: str, args: list[str], timeout: float, secret: object = None) -> str:
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        if secret:  # River's errors quote the database URL, password and all
            for spelling in {str(secret), urllib.parse.quote(str(secret), safe="")}:
                said = said.replace(spelling, "***")
        raise RuntimeError(f"river {args[0]} exited {done.returncode}: {said[-300:]}")
    return done.stdout + done.stderr


def summary(report: Report, plan: Plan, line) -> None:
    """vigil's throughput over River's, each ratio against issue 55's target."""
    peer = report.value(FIGURES[0])
    for figure, (label, target) in TARGETS.items():
        ours = report.value(figure)
        if plan.river_seconds <= 0:
            line(label, None, f"skipped in --{plan.name}", None)
        elif peer is None or ours is None:
            why = report.figures[FIGURES[0]].pending if peer is None and FIGURES[0] in report.figures else None
            line(label, None, f"missing input ({why})" if why else "missing input", None)
        else:
            ratio = ours / peer
            line(
                label,
                ratio,
                f"{figure} {fmt(ours)} / River {fmt(peer)} jobs/s = {ratio:.2f} (target >= {target:.2f})",
                ratio >= target,
            )
