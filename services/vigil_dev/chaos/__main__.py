"""``python -m vigil_dev.chaos --seed N``: one seeded chaos run; exit 0 on PASS, 1 on FAIL.

The last line is the summary:
``chaos: N faults, M acked, lost X, duplicated Y, overlaps Z, stuck W[, calls C, two keys K,
two calls T], poison dead P of Q, healthy dead H, unrun U, waiting B of N users, notices bad M,
tasks ended E of A, tasks bad X, approvals R (yes Y, no N, expired E), approvals bad B -> PASS|FAIL``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import threading
import time
from pathlib import Path

from vigil.paths import repo_root
from vigil_dev.chaos import actions
from vigil_dev.chaos.approvals import Approver
from vigil_dev.chaos.checks import Fault, approvals_verdict, recovery_times, shard_outage_line, unsettled, verdict
from vigil_dev.chaos.load import Cast, Load
from vigil_dev.chaos.stack import ChaosStack, Ports, Supervisor

KINDS = (
    "kill-worker",
    "kill-ingest",
    "kill-scheduler",
    "kill-dispatcher",
    "kill-kafka",
    "kill-postgres",
    "freeze-worker",
    "kill-mcp",
    "kill-shard",
)
# Only with several shards (--shards): SIGKILL the last shard's PostgreSQL server, whose users
# wait for its restart while the other shards' users must go on being served.
SHARD_KINDS = ("kill-shard",)
# A frozen worker stays stopped this much longer than its session timeout: long enough for the
# group to give its partitions away, so that it wakes up fenced.
FREEZE_EXTRA_S = 3.0
# The budgeted users' profiles: (name, times --daily-tokens). A chaos run's Claude run bills
# about a thousand tokens (three model calls, the prompt cached): the tight budget is spent
# within the first seconds of the load, the roomy one later, so both the refusal of new runs
# and the runs that start near the end of the budget (capped at what is left) happen under faults.
BUDGETS = (("chaos-tight", 1), ("chaos-roomy", 8))
DAILY_TOKENS = 4000
# The approval users' profile: every action asks first (the MCP look-up and the replies do not).
APPROVALS_PROFILE = "chaos-approvals"
APPROVALS_TOOLS = f"http_request=ask,send_message=allow,{actions.MCP_TOOL}=allow"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vigil_dev.chaos", description=__doc__)
    p.add_argument("--seed", type=int, default=1, help="seeds the faults' order and timing and the clients")
    p.add_argument("--faults", type=int, default=30, help="how many faults to inject")
    p.add_argument("--users", type=int, default=40, help="users sending chat messages")
    p.add_argument("--rate", type=float, default=45.0, help="messages per second, all users together")
    p.add_argument("--gap", type=float, nargs=2, default=(4.0, 8.0), metavar=("MIN", "MAX"), help="seconds between")
    p.add_argument(
        "--kinds",
        default=None,
        help="fault kinds, comma-separated: " + ", ".join(KINDS) + " (default: all; kill-shard only with --shards 2+)",
    )
    p.add_argument(
        "--shards",
        type=int,
        choices=(1, 2, 3, 4),
        default=1,
        help="ledger shards, each on a PostgreSQL server of its own",
    )
    p.add_argument("--workers", type=int, choices=(1, 2), default=2, help="worker processes in one group")
    p.add_argument("--dispatchers", type=int, choices=(1, 2), default=2, help="dispatcher replicas")
    p.add_argument("--session-timeout-ms", type=int, default=10_000, help="the worker's Kafka session timeout")
    p.add_argument("--settle-s", type=float, default=180.0, help="how long the stack may take to settle at the end")
    p.add_argument("--run-dir", type=Path, default=repo_root() / ".run" / "chaos", help="the stack's folder")
    p.add_argument("--port-base", type=int, default=None, help="ports base..base+9 (default: free ports)")
    p.add_argument("--keep", action="store_true", help="leave the stack running at the end")
    p.add_argument(
        "--agent",
        choices=("claude", "echo"),
        default="claude",
        help="claude: every run POSTs to a receiver of the run's own and the check 'no call under two keys' "
        "holds (the scripted Messages API); echo: no model, no action",
    )
    p.add_argument(
        "--poison-users",
        type=int,
        default=3,
        help="users who send one poison message each, whose call kills its worker every time (claude agent only)",
    )
    p.add_argument(
        "--budgeted",
        type=int,
        nargs=2,
        default=(2, 2),
        metavar=("TIGHT", "ROOMY"),
        help=f"users under the daily budgets {BUDGETS[0][0]} and {BUDGETS[1][0]} (profiles the run creates)",
    )
    p.add_argument(
        "--daily-tokens",
        type=int,
        default=DAILY_TOKENS,
        help=f"{BUDGETS[0][0]}'s daily tokens ({BUDGETS[1][0]}: {BUDGETS[1][1]} times as many)",
    )
    p.add_argument(
        "--task-users",
        type=int,
        default=2,
        help="users whose every 7th message asks for a background task (claude agent only)",
    )
    p.add_argument(
        "--approval-users",
        type=int,
        default=2,
        help=f"users under the profile {APPROVALS_PROFILE}, which asks before every action; their questions are "
        "answered yes, no or too late (claude agent only)",
    )
    return p.parse_args(argv)


def say(began: float, text: str) -> None:
    print(f"[{time.time() - began:7.1f}s] {text}", flush=True)


def schedule(rng: random.Random, kinds: list[str], count: int) -> list[str]:
    """``count`` faults, every kind as often as the others (give or take one), in seeded order."""
    plan = (kinds * math.ceil(count / len(kinds)))[:count]
    rng.shuffle(plan)
    return plan


def inject(stack: ChaosStack, kind: str, fault: Fault, rng: random.Random) -> str:
    action, target = kind.split("-", 1)
    # With two workers, a worker fault hits one of them (seeded): the other takes its partitions.
    # With two dispatchers, likewise: the other goes on, and takes the lost sends after their lease.
    replicas = {"worker": stack.workers, "dispatcher": stack.dispatchers, "mcp": stack.workers}
    mcp = target == "mcp"
    target = rng.choice(replicas[target]) if target in replicas else target
    fault.target = target
    if mcp:  # the worker's MCP stdio server alone: no restart, the worker's next call starts it
        fault.target = f"mcp of {target}"
        return f"{stack.kill_mcp(target)} MCP server process(es) of {target} killed"
    if target in stack.workers:
        fault.partitions = stack.held(target)  # whose users' recovery this fault is measured on
    if target == "shard":  # the last shard's server: the others keep serving their users
        target = fault.target = f"postgres-{stack.shards - 1}"
    if action == "freeze":
        seconds = stack.session_timeout_ms / 1000 + FREEZE_EXTRA_S
        if not stack.freeze(target, seconds):
            return f"{target} not running"
        return f"{target} stopped for {seconds:.0f} s"
    if not stack.kill(target):
        return f"{target} not running (restarting)"
    fault.restart_s = stack.up()
    return f"{target} restarted in {fault.restart_s:.1f} s"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    every = KINDS if args.shards > 1 else tuple(k for k in KINDS if k not in SHARD_KINDS)
    kinds = [k.strip() for k in (args.kinds or ",".join(every)).split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"unknown fault kind(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    if args.shards == 1 and set(kinds) & set(SHARD_KINDS):
        print("kill-shard needs --shards 2 or more (SHARDS=2)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    receiver = actions.Receiver() if args.agent == "claude" else None
    cast = Cast.pick(
        args.users,
        args.poison_users if receiver else 0,  # the echo agent makes no call: nothing can poison it
        {name: count for (name, _), count in zip(BUDGETS, args.budgeted)},
        args.task_users if receiver else 0,
        args.approval_users if receiver else 0,
    )
    extra = actions.environment(receiver.host) if receiver else {}
    stack = ChaosStack(
        args.run_dir.resolve(),
        Ports.pick(args.port_base),
        args.session_timeout_ms,
        extra,
        args.workers,
        args.dispatchers,
        script=actions.script(receiver.host) if receiver else None,
        shards=args.shards,
    )
    began = time.time()
    say(
        began,
        f"chaos seed {args.seed}: fresh stack in {stack.root}, workers {', '.join(stack.workers)}, "
        f"dispatchers {', '.join(stack.dispatchers)}, ledger shards {args.shards}",
    )
    stack.fresh()
    supervisor = Supervisor(stack)
    try:
        say(began, f"stack up in {stack.up():.1f} s")
        budgets(stack, args, cast, began)
        approval_profile(stack, args, cast)
        if receiver is not None:
            receiver.poison = lambda port: poisoned(stack, supervisor, port, receiver.port, began)
        return run(args, rng, kinds, stack, began, receiver, cast, supervisor)
    finally:
        supervisor.stop()
        if receiver is not None:
            receiver.close()
        if args.keep:
            say(began, f"stack left running (VIGIL_DEV_RUN_DIR={stack.root} vigil-dev down stops it)")
        else:
            stack.down()


def budgets(stack: ChaosStack, args: argparse.Namespace, cast: Cast, began: float) -> None:
    """The budget profiles, each assigned to its users by their exact id (the workers read the
    assignments within VIGIL_PROFILE_CACHE_S, before the load's first seconds are over)."""
    times = dict(BUDGETS)
    for name, users in cast.budgeted.items():
        if not users:
            continue
        stack.vigil("profiles", "create", name, "--daily-tokens", str(args.daily_tokens * times[name]))
        for n in sorted(users):
            stack.vigil("profiles", "assign", f"chaos-{args.seed}-u{n:03d}", name)
    daily = {name: args.daily_tokens * times[name] for name in cast.budgeted}
    parts = [f"{name} ({daily[name]} tokens a day): {len(us)}" for name, us in cast.budgeted.items()]
    say(
        began,
        f"users: {len(cast.poison)} with a poison message, {len(cast.tasks)} delegating tasks, "
        f"{len(cast.approvals)} asked to approve every action, "
        f"budgeted {', '.join(parts)}",
    )


def approval_profile(stack: ChaosStack, args: argparse.Namespace, cast: Cast) -> None:
    """The approval users' profile, assigned to each of them."""
    if not cast.approvals:
        return
    stack.vigil("profiles", "create", APPROVALS_PROFILE, "--tools", APPROVALS_TOOLS, "--allow-unknown")
    for n in sorted(cast.approvals):
        stack.vigil("profiles", "assign", f"chaos-{args.seed}-u{n:03d}", APPROVALS_PROFILE)


def poisoned(stack: ChaosStack, supervisor: Supervisor, port: int, peer: int, began: float) -> None:
    """A poison call arrived from ``port`` at the receiver's ``peer``: its worker dies now, and
    the supervisor brings it back."""
    worker = stack.caller(port, peer)
    for _ in range(25):  # a worker restarted a moment ago: its pid file, its socket, in a moment
        if worker is not None:
            break
        time.sleep(0.2)
        worker = stack.caller(port, peer)
    if worker is None:
        say(began, f"poison call from port {port}: no worker of ours holds it (not killed)")
        return
    supervisor.kill(worker)
    say(began, f"poison: {worker} killed by its own call (the supervisor brings it back)")


def run(
    args: argparse.Namespace,
    rng: random.Random,
    kinds: list[str],
    stack: ChaosStack,
    began: float,
    receiver: actions.Receiver | None = None,
    cast: Cast | None = None,
    supervisor: Supervisor | None = None,
) -> int:
    cast = cast or Cast()
    load = Load(stack.ingest_url, stack.api_token(), args.users, args.rate, args.seed, cast)
    prefix = f"chaos-{args.seed}-"
    thread = threading.Thread(target=lambda: asyncio.run(load.run()), name="load", daemon=True)
    thread.start()
    approver = Approver(
        stack.dsns, stack.ingest_url, prefix, frozenset(load.user_id(n) for n in cast.approvals), args.seed
    )
    answering = threading.Thread(target=lambda: asyncio.run(approver.run()), name="approver", daemon=True)
    answering.start()
    time.sleep(3.0)  # the clients get going before the first fault
    faults: list[Fault] = []
    for n, kind in enumerate(schedule(rng, kinds, args.faults), 1):
        time.sleep(rng.uniform(*args.gap))
        if supervisor is not None:
            supervisor.quiet(args.gap[0])
        with stack.lock:  # never while the supervisor brings a poisoned worker back
            fault = Fault(kind, time.time())
            faults.append(fault)
            what = inject(stack, kind, fault, rng)
        say(began, f"fault {n}/{args.faults}: {kind} ... {what} ({len(load.acked)} acked so far)")
    say(began, "faults done; the clients finish what they began")
    load.stop_sending(args.settle_s)
    thread.join(args.settle_s + 30)
    say(began, f"{len(load.acked)} acknowledged; refusals on the way: {dict(sorted(load.refusals.items()))}")
    deadline = time.monotonic() + args.settle_s
    left = unsettled(stack.dsns, prefix, load.acked)
    while any(left) and time.monotonic() < deadline:
        time.sleep(1.0)
        left = unsettled(stack.dsns, prefix, load.acked)
    say(
        began,
        f"settled after {time.monotonic() - deadline + args.settle_s:.1f} s: {left[0]} acknowledged not "
        f"recorded, {left[1]} events, {left[2]} messages, {left[3]} tasks and {left[4]} approvals still moving",
    )
    approver.stop()
    answering.join(30)
    budgeted = frozenset(load.user_id(n) for users in cast.budgeted.values() for n in users)
    v, rows = verdict(
        stack.dsns, prefix, load.acked, stack.dispatcher_logs(), stack.ready(), budgeted, receiver is not None
    )
    if receiver is not None:
        poison_users = frozenset(load.user_id(n) for n in cast.poison)
        v.act(receiver.keys_by_call(), receiver.calls_by_key(), len(receiver.seen), poison_users)
        approvals_verdict(v, stack.dsns, prefix, approver.answers, set(receiver.calls_by_key()))
    recovery_times(faults, rows)
    report(faults, v, began)
    if stack.shards > 1:
        print(shard_outage_line(faults, rows, killed=stack.shards - 1), flush=True)
    calls = f", calls {v.calls}, two keys {v.two_keys}, two calls {v.two_calls}" if receiver is not None else ""
    summary = (
        f"chaos: {len(faults)} faults, {v.acked} acked, lost {v.lost}, duplicated {v.duplicated}, "
        f"overlaps {v.overlaps}, stuck {v.stuck}{calls}, poison dead {v.poison_dead} of {v.poison}, "
        f"healthy dead {v.healthy_dead}, unrun {v.unrun}, waiting {v.waiting} of {v.waiting_users} users, "
        f"notices bad {v.notices}, tasks ended {v.tasks_ended} of {v.tasks}, tasks bad {v.tasks_bad}, "
        f"approvals {v.approvals} (yes {v.approvals_yes}, no {v.approvals_no}, expired {v.approvals_expired}), "
        f"approvals bad {v.approvals_bad} -> {'PASS' if v.passed else 'FAIL'}"
    )
    print(summary, flush=True)
    return 0 if v.passed else 1


SLOWEST = 3


def report(faults: list[Fault], v, began: float) -> None:
    print(
        "\nrecovery per fault kind (injection -> first run of a message sent after it; a worker fault: of a user"
        " on a partition that worker held; restart = vigil-dev up)"
    )
    print(f"  {'kind':<16} {'n':>3} {'median s':>9} {'max s':>7} {'restart median s':>17}")
    for kind in sorted({f.kind for f in faults}):
        mine = [f for f in faults if f.kind == kind]
        rec = [f.recovery_s for f in mine if f.recovery_s is not None]
        restart = [f.restart_s for f in mine if f.restart_s is not None]
        med = f"{statistics.median(rec):.1f}" if rec else "-"
        top = f"{max(rec):.1f}" if rec else "-"
        rmed = f"{statistics.median(restart):.1f}" if restart else "-"
        print(f"  {kind:<16} {len(mine):>3} {med:>9} {top:>7} {rmed:>17}")
    slow = sorted((f for f in faults if f.recovery_s is not None), key=lambda f: -f.recovery_s)[:SLOWEST]
    if slow:
        print("slowest recoveries (with the faults injected before they ended)")
    for f in slow:
        during = [o for o in faults if f.at < o.at < f.at + f.recovery_s]
        meanwhile = ", ".join(f"{o.kind} ({o.target}) at {o.at - began:.0f}s" for o in during) or "none"
        print(f"  {f.kind} ({f.target}) at {f.at - began:.0f}s: {f.recovery_s:.1f} s; meanwhile: {meanwhile}")
    print("\ninvariants")
    checks = [
        ("acknowledged -> recorded exactly once (lost)", v.lost),
        ("each event in one run, each message under one delivery id (duplicated)", v.duplicated),
        ("no overlapping runs per user (overlaps)", v.overlaps),
        ("runs and events in order per user (misordered)", v.misordered),
        ("nothing pending or running, every message delivered (stuck)", v.stuck),
        ("every service ready at the end (not ready)", len(v.not_ready)),
        ("no logical call seen under two idempotency keys (two keys)", v.two_keys),
        ("no idempotency key seen for two logical calls (two calls)", v.two_calls),
        ("every poison event dead with its reason, in no run (poison alive)", v.poison_alive),
        ("no healthy event dead (healthy dead)", v.healthy_dead),
        ("no event done without a run that took it and made a model call (unrun)", v.unrun),
        ("each user waiting for the budget told once, and only they (notices bad)", v.notices),
        ("every background task ended and reported, or open before its deadline (tasks bad)", v.tasks_bad),
        ("approvals answered or expired, run only if approved, late answers refused (approvals bad)", v.approvals_bad),
    ]
    for name, bad in checks:
        print(f"  {'ok  ' if not bad else 'FAIL'} {name}: {bad}")
    print(f"  (copies of a delivery id re-sent after a dispatcher crash, dropped by receivers: {v.copies})")
    print(f"  (calls made again with their key, in doubt after a worker fault: {v.repeats} of {v.calls} calls)")
    print(f"  (a poison user's calls made again under their own key by an isolated lone run: {v.remade})")
    print(f"  (events of budgeted users waiting for the next UTC day: {v.waiting}, of {v.waiting_users} users)")
    print(f"  (background tasks: {v.tasks}, ended and reported {v.tasks_ended}, open {v.tasks_open})")
    if v.not_ready:
        print(f"  not ready: {', '.join(v.not_ready)}")
    for line in v.examples:
        print(f"  - {line}")
    print()


if __name__ == "__main__":
    sys.exit(main())
