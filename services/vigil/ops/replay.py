"""`vigil runs replay`: what-if replays of kept runs, one side by side or a canary over a sample
(docs/agent.md, "Changing an agent safely"; the replay itself: :mod:`vigil.agent.whatif`).

Reads the ledger (the kept journal, its events, the user's memory, profile versions) and
writes only a ``run_replays`` row per replay (what the console's run page lists); the model
is asked anew through the client ``ANTHROPIC_*`` configures.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click

from vigil.admin.shards import Shards
from vigil.agent.profiles import Profile, ProfileRefused, parse_spec
from vigil.agent.settings import AgentSettings
from vigil.agent.whatif import DIFFERENT, NEW, NEW_ACTIONS, SAME, Kept, Replay, Side, WhatIfAgent
from vigil.cliutil import login_name
from vigil.ledger import journal as ledger_journal
from vigil.ledger import profiles as ledger_profiles
from vigil.ledger import replays as ledger_replays
from vigil.ledger.db import connect
from vigil.service import load_or_exit
from vigil.settings import CommonSettings

SINCE = re.compile(r"^(\d+)([mhd])$")
UNITS = {"m": "minutes", "h": "hours", "d": "days"}
COLUMN = 56  # characters of one side in the side-by-side view


@click.command("replay")
@click.argument("run_key", required=False)
@click.option("--profile", "profile_name", help="Replay with this profile (its latest version, or --profile-version).")
@click.option("--profile-version", type=int, help="This version of --profile, or of the run's recorded profile.")
@click.option("--model", help="Ask this model instead of the profile's.")
@click.option(
    "--system-prompt-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The profile's part of the system prompt, from this file.",
)
@click.option("--sample", type=click.IntRange(1, 1000), help="A canary: replay this many kept runs.")
@click.option(
    "--since", default="1d", show_default=True, help="The canary's runs: finished this long ago at most (30m, 12h, 1d)."
)
@click.option(
    "--against-version", type=int, help="The canary's version: of --profile, or of each run's recorded profile."
)
@click.option(
    "--against-profile",
    help="The canary replays against this profile (a draft assigned to nobody): its --against-version, else latest.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object (for CI).")
def replay(
    run_key: str | None,
    profile_name: str | None,
    profile_version: int | None,
    model: str | None,
    system_prompt_file: Path | None,
    sample: int | None,
    since: str,
    against_version: int | None,
    against_profile: str | None,
    as_json: bool,
) -> None:
    """Run a kept run again against a changed agent, executing nothing, and show both runs.

    RUN_KEY (`<user>:<first event id>`) replays one run side by side; --sample N replays a
    canary of N kept runs and prints how many took the same actions. Needs kept journals
    (VIGIL_RUN_JOURNAL_DAYS > 0). Recorded tool outcomes are served from the journal; a call the
    recorded run did not make is shown and not executed; nothing is sent or written."""
    if (run_key is None) == (sample is None):
        raise click.UsageError("give a RUN_KEY, or --sample N for a canary")
    if sample is not None and against_version is None and profile_version is None and against_profile is None:
        raise click.UsageError("--sample needs --against-version M or --against-profile Q")
    if against_profile is not None and sample is None:
        raise click.UsageError("--against-profile is the canary's (--sample N); one run takes --profile")
    if not os.environ.get("ANTHROPIC_API_KEY") and not os.environ.get("ANTHROPIC_AUTH_TOKEN"):
        raise click.UsageError(
            "ANTHROPIC_API_KEY: the replay asks the model anew (for the scripted server, set it and ANTHROPIC_BASE_URL)"
        )
    shards = Shards(load_or_exit(CommonSettings))
    prompt = system_prompt_file.read_text(encoding="utf-8") if system_prompt_file else None
    agent = WhatIfAgent(load_or_exit(AgentSettings), model=model, prompt=prompt)
    try:
        if run_key is not None:
            kept = _kept(shards, run_key)
            target = _target(shards, kept, profile_name, profile_version)
            done = asyncio.run(_replay_all(agent, [(kept, target)]))[0]
            _record(shards, [done])
            if as_json:
                click.echo(json.dumps(done.view(), default=str))
            else:
                _print_one(done)
            return
        version = against_version if against_version is not None else profile_version
        assert sample is not None
        runs = _sample(shards, sample, _since(since), profile_name)
        pairs = [(kept, _target(shards, kept, against_profile or profile_name, version)) for kept in runs]
        replays = asyncio.run(_replay_all(agent, pairs))
        _record(shards, replays)
        _print_canary(replays, since, profile_name, against_profile, version, as_json)
    finally:
        asyncio.run(agent.close())


def _record(shards: Shards, replays: Sequence[Replay]) -> None:
    """A row per replay for the console's run page (in the run's user's shard)."""
    made_by = login_name()
    for done in replays:
        user = done.run_key.rpartition(":")[0]
        report = json.dumps(done.view(), default=str)
        with shards.user_connection(user) as conn:
            ledger_replays.record(
                conn,
                run_key=done.run_key,
                user_id=user,
                made_by=made_by,
                ran_with=done.replay.label,
                verdict=done.verdict,
                messages_changed=done.messages_changed,
                report=report,
            )


async def _replay_all(agent: WhatIfAgent, pairs: Sequence[tuple[Kept, Profile | None]]) -> list[Replay]:
    """One after the other: a canary is a background check, and the model's rate is shared."""
    return [await agent.replay(kept, profile) for kept, profile in pairs]


def _since(text: str) -> datetime:
    found = SINCE.match(text)
    if found is None:
        raise click.UsageError(f"--since {text!r}: a number and m, h or d (30m, 12h, 1d)")
    return datetime.now(UTC) - timedelta(**{UNITS[found[2]]: int(found[1])})


def _kept(shards: Shards, run_key: str) -> Kept:
    """The kept run of ``run_key`` (its last journal: a run that started over is under ``~N``)."""
    user, _, first = run_key.rpartition(":")
    if not user or not first.split("~")[0].isdigit():
        raise click.UsageError(f"RUN_KEY {run_key!r}: expected <user>:<first event id>")
    base = run_key.split("~")[0]

    def read(dsn: str) -> Kept:
        with connect(dsn, autocommit=True) as conn:
            rows = ledger_journal.steps(conn, base)
            finished = sorted({r.run_key for r in rows if r.finished_at is not None})
            if not finished:
                live = " (its journal is live: the run has not finished)" if rows else ""
                raise click.ClickException(
                    f"no kept journal of {run_key}{live}; runs are kept while VIGIL_RUN_JOURNAL_DAYS > 0"
                )
            key = run_key if run_key in finished else finished[-1]
            steps = [r for r in rows if r.run_key == key]
            kept = Kept(key, user, steps, [], {})
            try:
                ids = kept.start["events"]
            except ValueError as exc:
                raise click.ClickException(str(exc)) from None
            events = ledger_replays.events(conn, user, ids)
            if len(events) != len(ids):
                raise click.ClickException(f"{key}: {len(ids) - len(events)} of its {len(ids)} events are gone")
            return Kept(key, user, steps, events, ledger_replays.memory(conn, user))

    return shards.on_user(user, read)


def _sample(shards: Shards, limit: int, since: datetime, profile: str | None) -> list[Kept]:
    found, _down = shards.each(lambda dsn: _read_sample(dsn, limit, since, profile))
    keys = sorted((r for f in found for r in f.value), key=lambda r: r.run_key)[:limit]
    if not keys:
        raise click.ClickException("no kept runs in that window; runs are kept while VIGIL_RUN_JOURNAL_DAYS > 0")
    return [_kept(shards, r.run_key) for r in keys]


def _read_sample(dsn: str, limit: int, since: datetime, profile: str | None) -> list[ledger_replays.KeptRun]:
    with connect(dsn, autocommit=True) as conn:
        return ledger_replays.sample(conn, since=since, profile=profile, limit=limit)


def _target(shards: Shards, kept: Kept, name: str | None, version: int | None) -> Profile | None:
    """The profile version ``kept`` replays with: ``name``'s (``version``, else its latest);
    without ``name``, the recorded profile's (``version``, else the recorded version)."""
    if name is None:
        if kept.profile is None:
            if version is not None:
                raise click.UsageError(f"{kept.run_key} ran with the default profile: give --profile with a version")
            return None
        name, recorded = kept.profile
        version = recorded if version is None else version
    with connect(shards.dsns[0], autocommit=True) as conn:
        row = ledger_profiles.get(conn, name, version)
    if row is None:
        raise click.ClickException(f"no profile {name!r}" + (f" version {version}" if version is not None else ""))
    try:
        return Profile(row.name, row.version, parse_spec(row.spec))
    except ProfileRefused as exc:
        raise click.ClickException(f"profile {row.name} v{row.version}: {exc}") from None


def _print_one(done: Replay) -> None:
    click.echo(f"replay of {done.run_key}: {done.verdict}" + (", messages changed" if done.messages_changed else ""))
    _columns("recorded: " + done.recorded.label, "replay: " + done.replay.label)
    for n in range(max(len(done.recorded.turns), len(done.replay.turns))):
        left, right = _turn(done.recorded, n), _turn(done.replay, n)
        for i in range(max(len(left), len(right))):
            _columns(left[i] if i < len(left) else "", right[i] if i < len(right) else "", f"{n + 1}" if i == 0 else "")
    _columns("messages:", "messages:")
    rec, new = done.recorded.messages or ["(none)"], done.replay.messages or ["(none)"]
    for i in range(max(len(rec), len(new))):
        _columns(rec[i] if i < len(rec) else "", new[i] if i < len(new) else "")
    (ri, ro), (ni, no) = done.recorded.tokens, done.replay.tokens
    _columns(f"tokens: {ri} in, {ro} out", f"tokens: {ni} in, {no} out")
    new_calls = [c for c in done.replay.calls if c.became == NEW]
    if new_calls:
        click.echo(
            f"{len(new_calls)} call(s) the recorded run did not make, not executed: "
            + "; ".join(f"{c.name} {json.dumps(c.input, default=str)}" for c in new_calls)
        )


def _turn(side: Side, n: int) -> list[str]:
    if n >= len(side.turns):
        return []
    turn = side.turns[n]
    lines = [f"{c.name} {json.dumps(c.input, default=str)} [{c.became}]" for c in turn.calls]
    if turn.text:
        lines.insert(0, f'"{turn.text}"')
    return (lines or ["(no call)"]) + [f"({turn.input_tokens}+{turn.output_tokens} tokens)"]


def _columns(left: str, right: str, step: str = "") -> None:
    cut = lambda s: s if len(s) <= COLUMN else s[: COLUMN - 3] + "..."  # noqa: E731
    click.echo(f"{step:>4}  {cut(left):<{COLUMN}}  {cut(right)}")


def _print_canary(
    replays: list[Replay], since: str, profile: str | None, against: str | None, version: int | None, as_json: bool
) -> None:
    by = {v: [r for r in replays if r.verdict == v] for v in (SAME, DIFFERENT, NEW_ACTIONS)}
    changed = [r for r in replays if r.messages_changed]
    before = sum(sum(r.recorded.tokens) for r in replays)
    after = sum(sum(r.replay.tokens) for r in replays)
    flag = f" --profile {against or profile}" if against or profile else ""
    pinned = f" --profile-version {version}" if version is not None else ""

    def pointer(r: Replay) -> str:
        return f"vigil runs replay {r.run_key}{flag}{pinned}"

    if as_json:
        out = {
            "runs": len(replays),
            "since": since,
            "profile": profile,
            "against_profile": against,
            "against_version": version,
            **{v.replace(" ", "_"): len(rs) for v, rs in by.items()},
            "messages_changed": len(changed),
            "tokens": {"before": before, "after": after},
            "runs_differing": [
                {"run_key": r.run_key, "verdict": r.verdict, "diff": pointer(r)} for r in replays if r.verdict != SAME
            ],
        }
        click.echo(json.dumps(out))
        return
    click.echo(
        f"canary: {len(replays)} kept runs since {since}"
        + (f" of {profile}" if profile else "")
        + (f", against {against}" if against else "")
        + (f", against version {version}" if version is not None else "")
    )
    click.echo(f"{'same actions':<20}{len(by[SAME]):>6}")
    for verdict in (DIFFERENT, NEW_ACTIONS):
        click.echo(f"{verdict:<20}{len(by[verdict]):>6}")
        for r in by[verdict]:
            click.echo(f"    {r.run_key}: {pointer(r)}")
    click.echo(f"{'messages changed':<20}{len(changed):>6}")
    click.echo(f"{'tokens before/after':<20}{before:>6} / {after}")


commands = [replay]
