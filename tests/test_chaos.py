"""`make chaos`, short: a seeded run of the nemesis against a dev stack of its own with two
ledger shards (about three minutes), which must end in PASS. The full run (`make chaos`: 30 faults of every
kind, Kafka kills and frozen workers included, more poison and budgeted users) is too long
for the suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SUMMARY = re.compile(
    r"^chaos: (\d+) faults, (\d+) acked, lost (\d+), duplicated (\d+), overlaps (\d+), stuck (\d+),"
    r" calls (\d+), two keys (\d+), two calls (?P<two_calls>\d+),"
    r" poison dead (?P<poison_dead>\d+) of (?P<poison>\d+), healthy dead (?P<healthy_dead>\d+), unrun (?P<unrun>\d+),"
    r" waiting (?P<waiting>\d+) of (?P<waiting_users>\d+) users,"
    r" notices bad (?P<notices>\d+), tasks ended (?P<tasks_ended>\d+) of (?P<tasks>\d+), tasks bad (?P<tasks_bad>\d+),"
    r" approvals (?P<approvals>\d+) \(yes (?P<yes>\d+), no (?P<no>\d+), expired (?P<expired>\d+)\),"
    r" approvals bad (?P<approvals_bad>\d+) -> (?P<verdict>PASS|FAIL)$"
)


@pytest.mark.stack  # starts a stack of its own, with two ledger shards on two PostgreSQL servers
@pytest.mark.solo  # load, a stack of its own and deadlines on recovery: the machine to itself
@pytest.mark.timeout(960)
def test_a_short_chaos_run_on_two_shards_loses_nothing_and_leaves_nothing_stuck(tmp_path):
    """Six faults under load on two ledger shards: each shard's PostgreSQL killed (the first
    shard's twice), a worker, a dispatcher and ingest killed. With a poison user (one message
    whose call kills its worker, three times) and a user on each budget: nothing acknowledged
    lost, the poison event dead, no healthy one, and no healthy batch's call made twice (each
    poison kill costs every claim in flight an attempt: a healthy batch lost twice so replays
    alone on its lone last attempt, issue 53); the budgeted users' events past their budget
    waiting, each such user told once; background tasks and the acting agent under their keys;
    two users whose every action waits for an approval answered yes, no or late; and the other
    shard's users served while the last shard was down. (One run where two ran before: each
    stack's start and settle is a minute of the suite, issue 54.)"""
    args = [
        *("--seed", "11", "--shards", "2", "--faults", "6", "--users", "8", "--rate", "12", "--gap", "1", "2"),
        *("--kinds", "kill-shard,kill-postgres,kill-worker,kill-dispatcher,kill-ingest,kill-shard"),
        *("--settle-s", "120", "--poison-users", "1", "--budgeted", "1", "1"),
        *("--run-dir", str(tmp_path / "stack")),
    ]
    result = subprocess.run(
        [sys.executable, "-m", "vigil_dev.chaos", *args], capture_output=True, text=True, timeout=900, env=os.environ
    )
    print(result.stdout[-6000:], result.stderr[-3000:])
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    match = SUMMARY.match(last)
    assert match, f"no summary line: {last!r}"
    faults, acked = int(match.group(1)), int(match.group(2))
    assert faults == 6 and acked > 100  # the faults happened under load
    # The acting agent: every run POSTed once, and no logical call was seen under two keys.
    assert int(match.group(7)) > 50 and int(match.group(8)) == 0 and int(match["two_calls"]) == 0
    assert (match["poison_dead"], match["poison"], match["healthy_dead"]) == ("1", "1", "0")
    assert int(match["waiting"]) > 0 and int(match["notices"]) == 0 and int(match["unrun"]) == 0
    # Approvals answered yes, no and too late under the faults: each approved call ran under its
    # request id, none other ran, every late answer was refused.
    assert min(int(match["yes"]), int(match["no"]), int(match["expired"])) > 0 and int(match["approvals_bad"]) == 0
    assert match["verdict"] == "PASS" and result.returncode == 0
    assert "fault 6/6: kill-" in result.stdout and "not running" not in result.stdout
    assert result.stdout.count(": kill-shard ... postgres-1 restarted") == 2, "the last shard's server was killed twice"
    assert result.stdout.count(": kill-postgres ...") == 1, "the first shard's server was killed"
    outage = re.search(r"while shard 1 was down (\S+) s \(n=(\d+)\)", result.stdout)
    assert outage and int(outage.group(2)) > 0, "shard 0's users ran while shard 1 was down"
    # The poison's call killed its worker on each attempt (a nemesis fault may have taken one
    # first), and once more if its batch replayed alone, uncounted, on its lead's last attempt.
    assert 1 <= result.stdout.count("killed by its own call") <= 4


def test_the_shard_outage_line_compares_the_other_shards_users_during_and_without_faults():
    from datetime import UTC, datetime

    from vigil_dev.chaos.checks import Fault, shard_outage_line

    def at(s: float) -> datetime:
        return datetime.fromtimestamp(s, UTC)

    kill = Fault("kill-shard", 1000.0, restart_s=10.0, recovery_s=12.0)
    other = Fault("kill-worker", 2000.0, restart_s=3.0, recovery_s=4.0)
    events, runs = [], []
    # (shard, received, latency): shard 1 was killed; its users never count.
    for n, (shard, got, took) in enumerate(
        # (0, 1995, 8.0): received before the worker kill, finished after it: not "without faults".
        [(0, 1002, 0.5), (0, 1008, 0.7), (1, 1003, 30.0), (0, 500, 0.1), (0, 600, 0.2), (0, 2001, 9.0), (0, 1995, 8.0)]
    ):
        events.append({"user_id": f"u{n}", "id": 1, "shard": shard, "received_at": at(got)})
        runs.append({"user_id": f"u{n}", "event_ids": [1], "outcome": "done", "finished_at": at(got + took)})
    line = shard_outage_line([kill, other], {"events": events, "runs": runs}, killed=1)
    assert line == (
        "shards other than 1: p99 received -> run finished while shard 1 was down 0.70 s (n=2); "
        "without faults 0.20 s (n=2)"
    ), line


def test_budget_notices_are_one_a_day_for_exactly_the_users_who_wait_today():
    """A chaos run that crossed midnight failed its notices check on four correct users: told
    on the 6th and again on the 7th (the budget started again at 00:00 UTC, their waiting
    events ran and spent it), the check wanted one notice in all."""
    from datetime import date

    from vigil_dev.chaos.checks import notice_problems

    today, yesterday = date(2026, 12, 7), date(2026, 12, 6)

    def told(user, *days):
        return [{"user_id": user, "day": d, "messages": len(days)} for d in days]

    assert notice_problems({"a": 742}, told("a", yesterday, today), today) == []
    assert notice_problems({"a": 5}, told("a", today), today) == []
    assert notice_problems({}, told("b", yesterday), today) == []  # ran within today's budget
    bad = {
        "waiting, never told": ({"a": 5}, []),
        "waiting, told only yesterday": ({"a": 5}, told("a", yesterday)),
        "told today, not waiting": ({}, told("b", today)),
        "two messages for one notice": ({"a": 5}, [{"user_id": "a", "day": today, "messages": 2}]),
    }
    for case, (waiting, notices) in bad.items():
        assert len(notice_problems(waiting, notices, today)) == 1, case


def test_the_poison_receiver_finds_its_caller_beside_a_closed_connection_on_the_same_port():
    """The poison receiver kills the worker whose socket comes from the caller's port. An
    ephemeral port can be shared by a closed connection's TIME_WAIT entry (no process owns it:
    inode 0); the lookup that stopped at the first entry found no worker, and the poison call
    got a cut connection instead of killing its caller (make chaos SEED=3 SHARDS=2: poison alive)."""
    import socket

    from vigil_dev.chaos.stack import ChaosStack

    def listener() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        return s

    first, second = listener(), listener()
    closed = socket.socket()
    closed.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.connect(first.getsockname())
    peer = first.accept()[0]
    closed.close()  # the client closes first: its port goes to TIME_WAIT
    peer.close()
    live = socket.socket()
    live.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    live.bind(("127.0.0.1", port))
    live.connect(second.getsockname())
    accepted = second.accept()[0]
    states = [
        line.split()[3]
        for line in open("/proc/net/tcp").read().splitlines()[1:]
        if int(line.split()[1].rsplit(":", 1)[1], 16) == port
    ]
    assert sorted(states) == ["01", "06"]  # established and TIME_WAIT, on one local port

    class OneWorker:
        workers = ["worker"]

        def pid(self, part: str) -> int:
            return os.getpid()

    try:
        assert ChaosStack.caller(OneWorker(), port) == "worker"  # type: ignore[arg-type]
    finally:
        for s in (live, accepted, first, second):
            s.close()


def test_a_poison_calls_worker_is_found_by_its_connection_to_the_receiver_not_by_its_port_alone():
    """Linux gives one ephemeral port to connections to different peers: the worker holding
    the local port towards Kafka is not the one that called the receiver from the same port
    (the short chaos run of 7 December killed the wrong worker so, and the poison event
    was done)."""
    import socket

    from vigil_dev.chaos.stack import ChaosStack

    receiver, elsewhere = socket.socket(), socket.socket()
    for listener in (receiver, elsewhere):
        listener.bind(("127.0.0.1", 0))
        listener.listen()
    other = socket.socket()
    other.connect(elsewhere.getsockname())  # another connection's port, to another peer
    port = other.getsockname()[1]
    accepted = elsewhere.accept()[0]

    class OneWorker:
        workers = ["worker"]

        def pid(self, part: str) -> int:
            return os.getpid()

    try:
        stack = OneWorker()
        assert ChaosStack.caller(stack, port, receiver.getsockname()[1]) is None  # type: ignore[arg-type]
        assert ChaosStack.caller(stack, port, elsewhere.getsockname()[1]) == "worker"  # type: ignore[arg-type]
    finally:
        for s in (other, accepted, receiver, elsewhere):
            s.close()


def test_the_supervisor_keeps_trying_a_worker_that_was_slow_to_come_up():
    """A loaded machine (four chaos stacks at once) made a restarted worker miss up()'s 60 s
    wait: StackError killed the supervisor's thread, no worker was brought back again and the
    nemesis waited for a quiet moment forever (make chaos SEED=3, 7 December). It tries again."""
    import threading
    import time

    from vigil_dev.chaos.stack import Supervisor
    from vigil_dev.devstack import StackError

    class SlowStack:
        lock = threading.Lock()
        ups = 0

        def kill(self, worker: str) -> None:
            pass

        def up(self) -> None:
            SlowStack.ups += 1
            if SlowStack.ups == 1:
                raise StackError("worker-b did not come up within 60s")

    supervisor = Supervisor(SlowStack())  # type: ignore[arg-type]
    try:
        supervisor.kill("worker-b")
        deadline = time.monotonic() + 10
        while supervisor.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (SlowStack.ups, supervisor.restarts) == (2, 1)
        supervisor.quiet(0.0)  # returns: nothing due or under way
    finally:
        supervisor.stop()
