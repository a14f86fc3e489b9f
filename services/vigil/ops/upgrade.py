"""`vigil runs upgrade`: move in-flight runs to a newer version of their profile (docs/agent.md,
"Changing an agent safely"), as Temporal's auto-upgrade moves running workflows.

A run in flight has a live journal whose start recorded its profile version; a replay keeps
that version (docs/worker.md, "Versions that hold"). This command writes, per run of the
profile on an older version, a ``run_upgrades`` row that the run's next replay reads: it goes
on under the new version from there. Its journaled steps stay facts (answers not asked again,
calls with an outcome not executed again, their keys their own); a step it no longer takes is
where it leaves the journal and goes on live, as any diverged replay does. Each shard's rows
and its audit row (who, when, how many) commit in one transaction.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import click

from vigil.admin.shards import Shards, report_down
from vigil.cliutil import INT_MAX, WholeNumber, login_name, table
from vigil.ledger import audit
from vigil.ledger import profiles as ledger_profiles
from vigil.ledger import upgrades as ledger_upgrades
from vigil.ledger.db import connect
from vigil.service import load_or_exit
from vigil.settings import CommonSettings

COLUMNS = ["run_key", "from_version", "state", "steps", "calls_done", "calls_in_doubt"]


@click.command("upgrade")
@click.option("--profile", "profile", required=True, help="The profile whose in-flight runs move.")
@click.option(
    "--to-version", "to_version", required=True, type=WholeNumber(1, INT_MAX), help="The version they move to."
)
@click.option("--dry-run", is_flag=True, help="List the runs that would move; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def upgrade(profile: str, to_version: int, dry_run: bool, as_json: bool) -> None:
    """Move the runs in flight on older versions of --profile to --to-version.

    Each moved run takes the version at its next replay (a takeover, a hand-over, a crash's
    retry); a run a worker holds now finishes on its own version unless it is handed over
    first. Its journaled steps are kept as facts: nothing it did is done again."""
    shards = Shards(load_or_exit(CommonSettings))
    with shards.connection(0) as conn:
        latest = ledger_profiles.get(conn, profile)
        target = ledger_profiles.get(conn, profile, to_version) if latest is not None else None
    if latest is None:
        raise click.UsageError(f"--profile {profile!r}: no such profile")
    if target is None:
        raise click.UsageError(f"--to-version {to_version}: profile {profile} has versions 1 to {latest.version}")
    if to_version <= 1:
        raise click.UsageError(
            f"--to-version {to_version}: not newer than any version of {profile}: nothing can move to it"
        )
    made_by = login_name()

    def step(dsn: str) -> list[dict[str, Any]]:
        with connect(dsn) as conn, conn.transaction():
            found = ledger_upgrades.in_flight(conn, profile=profile, to_version=to_version)
            moved = (
                set()
                if dry_run or not found
                else set(ledger_upgrades.move(conn, found, profile=profile, to_version=to_version, made_by=made_by))
            )
            if not dry_run:
                detail = {
                    "profile": profile,
                    "to_version": to_version,
                    "runs": len(moved),
                    "from_versions": sorted({r.from_version for r in found if r.run_key in moved}),
                    "run_keys": sorted(moved),
                }
                audit.record(conn, actor=made_by, action="runs.upgrade", detail=detail)
        return [_row(r, dry_run or r.run_key in moved) for r in found]

    answers, down = shards.each(step)
    rows = [{**({"shard": a.shard} if shards.many else {}), **row} for a in answers for row in a.value]
    _report(rows, profile, to_version, dry_run, as_json)
    report_down(down)


def _row(run: ledger_upgrades.InFlight, moved: bool) -> dict[str, Any]:
    row = asdict(run)
    row["state"] = "claimed" if row.pop("claimed") else "awaiting replay"
    row["moved"] = moved  # False: its journal ended (the run finished on its version) meanwhile
    return row


def _report(rows: list[dict[str, Any]], profile: str, to_version: int, dry_run: bool, as_json: bool) -> None:
    moved = [r for r in rows if r["moved"]]
    if as_json:
        out = {"profile": profile, "to_version": to_version, "dry_run": dry_run, "moved": len(moved), "runs": rows}
        click.echo(json.dumps(out))
        return
    verb = "would move" if dry_run else "moved"
    click.echo(f"{verb} {len(moved)} run(s) in flight on older versions of {profile} to version {to_version}")
    if not rows:
        return
    table(rows, (["shard"] if "shard" in rows[0] else []) + COLUMNS + ["moved"])
    done = sum(r["calls_done"] for r in moved)
    doubt = sum(r["calls_in_doubt"] for r in moved)
    click.echo(
        f"Each goes on under version {to_version} at its next replay; a claimed run finishes on its own version "
        "unless it is handed over or taken over first. Their journaled steps are facts: no answer is asked again, "
        f"the {done} call(s) with an outcome are not executed again (their results stay in the transcript, under "
        f"their keys), and the {doubt} call(s) in doubt run again with their own key only if version {to_version} "
        "still offers their tool (else the model reads that it is gone). A step a run no longer takes is where it "
        'leaves its journal and goes on live (vigil_run_replays_total{reason="diverged"}).'
    )


commands = [upgrade]
