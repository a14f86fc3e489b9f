"""The chaos run's verdict: the invariants, from the ledger and the dispatcher's delivery log.

- acknowledged -> recorded exactly once (``lost``: an acknowledged message with no event);
- each event in exactly one run that did not fail, each message under one delivery id
  (``duplicated``: a second run of an event, a second delivery id for one message, a second
  event for one key);
- no overlapping runs per user (``overlaps``);
- runs in event order per user, and events in the order the user sent them (``misordered``);
- nothing left pending or running, every message delivered (``stuck``), except a budgeted
  user's events waiting for the next UTC day (``waiting``);
- every service ready at the end;
- with the acting agent (vigil_dev.chaos.actions): no logical call seen under two
  idempotency keys (``two_keys``), no key seen for two calls (``two_calls``);
- poison (vigil_dev.chaos.load.POISON): every poison event ends ``dead`` with its reason and
  in no run (``poison_alive``), no healthy event ends ``dead`` (``healthy_dead``);
- no event ``done`` without a run that took it and, with the acting agent, made a model call
  (``unrun``): a budget must stop a run before it starts, never end its events unread;
- budgets: a user's events wait for the budget only if their profile has one, and each user
  who waits was told once that UTC day (one ``budget_notices`` row and one outbox message a
  day: ``notices``, :func:`notice_problems`);
- background tasks: each ended and reported (its result event then done in a run, as every
  event), or still open before its deadline (``tasks_bad`` otherwise);
- approvals (vigil_dev.chaos.approvals): every request answered or expired, an approved call
  run under the request id as its key, no call for a request denied or expired, an answer
  sent after the deadline refused, one in time stored as sent or refused only because the
  deadline or the same answer came first (``approvals_bad`` otherwise).

Copies of one delivery id (a dispatcher killed between the send and its commit sends it
again) are counted, not failed: the receiver drops them by id.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path

from vigil.ledger.db import connect
from vigil_dev.chaos.approvals import Answer
from vigil_dev.chaos.load import POISON, Acked
from vigil_dev.queries import Q


@dataclass
class Fault:
    kind: str
    at: float  # wall clock when injected
    restart_s: float | None = None  # how long `vigil-dev up` took to bring it back
    recovery_s: float | None = None  # injection -> first run of a message sent after it
    partitions: list[int] | None = None  # a worker fault: the partitions that worker held
    target: str = ""  # the process it hit (which worker, for a worker fault)


@dataclass
class Verdict:
    acked: int = 0
    lost: int = 0
    duplicated: int = 0
    overlaps: int = 0
    misordered: int = 0
    stuck: int = 0
    copies: int = 0  # extra copies of a delivery id (allowed)
    calls: int = 0  # logical calls the agent made on the chaos receiver (durable runs)
    two_keys: int = 0  # ... seen under more than one idempotency key (never allowed)
    two_calls: int = 0  # idempotency keys seen for more than one logical call (never allowed)
    remade: int = 0  # a poison user's calls made again under their own key by an isolated run (allowed)
    repeats: int = 0  # requests past one per call: made again, with the same key, in doubt (allowed)
    poison: int = 0  # poison events recorded
    poison_dead: int = 0  # ... ended dead with a reason (all must)
    poison_alive: int = 0  # ... done, or dead without a reason, or in a run that did not fail (never allowed)
    healthy_dead: int = 0  # healthy events dead (never allowed)
    unrun: int = 0  # events done without a run that took them and made a model call (never allowed)
    waiting: int = 0  # budgeted users' events waiting for the next UTC day (allowed)
    waiting_users: int = 0  # ... of this many users
    notices: int = 0  # users told of their budget other than exactly once, if they wait (never allowed)
    tasks: int = 0  # background tasks delegated
    tasks_ended: int = 0  # ... ended and reported
    tasks_open: int = 0  # ... still open before their deadline (allowed)
    tasks_bad: int = 0  # ... open past their deadline, or ended and never reported (never allowed)
    approvals: int = 0  # approval requests of the approval users
    approvals_yes: int = 0  # ... approved (their call ran)
    approvals_no: int = 0  # ... denied
    approvals_expired: int = 0  # ... expired (answered late on purpose, or in time but held up by a fault)
    approvals_bad: int = 0  # a promise of the approvals broken (never allowed)
    not_ready: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        bad = self.lost or self.duplicated or self.overlaps or self.misordered or self.stuck or self.two_keys
        promises = self.two_calls or self.poison_alive or self.healthy_dead or self.unrun or self.notices
        promises = promises or self.tasks_bad or self.approvals_bad
        return not (bad or promises or self.not_ready)

    def act(
        self,
        keys_by_call: dict[str, set[str]],
        calls_by_key: dict[str, set[str]],
        requests: int,
        poison_users: frozenset[str] = frozenset(),
    ) -> None:
        """The acting agent's check (vigil_dev.chaos.actions): one key per logical call, one
        call per key. A poison user's healthy call may be made again under its own key when
        the lone last attempt of a batch the poison killed does not replay the batch's journal
        (docs/worker.md, "A poison event harms only itself"): counted as ``remade``."""
        self.calls = len(keys_by_call)
        self.repeats = requests - self.calls
        for call, keys in keys_by_call.items():
            if len(keys) > 1 and call.rsplit(" from ", 1)[-1] in poison_users:
                self.remade += len(keys) - 1
                self.note(f"remade (allowed): the poison user's call for {call!r} under {sorted(keys)}")
            elif len(keys) > 1:
                self.two_keys += 1
                self.note(f"two keys: the call for {call!r} under {sorted(keys)}")
        for key, calls in calls_by_key.items():
            if len(calls) > 1:
                self.two_calls += 1
                self.note(f"two calls: key {key!r} for {sorted(calls)}")

    def note(self, text: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(text)


def _read(dsns: list[str], query, prefix: str) -> list[dict]:
    """``query``'s rows from every shard, each tagged with its ``shard``. Ids are unique within a
    shard only; a user's rows are all on one shard, so (user, id) names a row across shards."""
    found: list[dict] = []
    for shard, dsn in enumerate(dsns):
        with connect(dsn, autocommit=True) as conn:
            found.extend({**row, "shard": shard} for row in conn.execute(query, {"prefix": prefix + "%"}).fetchall())
    return found


def unsettled(dsns: list[str], prefix: str, acked: list[Acked]) -> tuple[int, int, int, int, int]:
    """Acknowledged messages not recorded yet, events not finished, messages not delivered,
    background tasks not ended and reported, approval requests open, over every shard."""
    counts = _read(dsns, Q.chaos_unsettled, prefix)
    recorded = {(e["user_id"], e["source_id"]) for e in _read(dsns, Q.chaos_events, prefix)}
    missing = sum(1 for a in acked if (a.user, a.key) not in recorded)
    return (
        missing,
        sum(c["events"] for c in counts),
        sum(c["messages"] for c in counts),
        sum(c["tasks"] for c in counts),
        sum(c["approvals"] for c in counts),
    )


def deliveries(logs: list[Path]) -> list[dict]:
    """The log channel's delivery documents, as the dispatchers wrote them (across restarts)."""
    found = []
    for log in logs:
        if not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"channel": "log"'):
                try:
                    found.append(json.loads(line)["data"])
                except (ValueError, KeyError):
                    continue  # a line cut by a SIGKILL mid-write
    return found


def verdict(
    dsns: list[str],
    prefix: str,
    acked: list[Acked],
    logs: list[Path],
    ready: dict[str, bool],
    budgeted: frozenset[str] = frozenset(),
    acting: bool = False,
) -> tuple[Verdict, dict]:
    """Check every invariant, over every shard: ``budgeted`` are the users with a daily budget,
    ``acting`` says every run is a Claude run (so a run that took events made a model call).
    Returns the verdict and the ledger's rows (for recovery times)."""
    events = _read(dsns, Q.chaos_events, prefix)
    runs = _read(dsns, Q.chaos_runs, prefix)
    outbox = _read(dsns, Q.chaos_outbox, prefix)
    notices = _read(dsns, Q.chaos_budget_notices, prefix)
    tasks = _read(dsns, Q.chaos_tasks, prefix)
    v = Verdict(acked=len(acked))
    v.not_ready = [name for name, ok in ready.items() if not ok]

    # Acknowledged -> recorded exactly once.
    rows_by_key = Counter((e["user_id"], e["source_id"]) for e in events)
    for a in acked:
        n = rows_by_key.get((a.user, a.key), 0)
        if n == 0:
            v.lost += 1
            v.note(f"lost: {a.key} acknowledged at {a.acked_at:.3f} and not in events")
        elif n > 1:
            v.duplicated += n - 1
            v.note(f"duplicated: {a.key} recorded {n} times")

    # Each event in exactly one run that did not fail, that run a model call; every event
    # finished: done, or dead if poison, or waiting for its user's budget if they have one.
    ran = Counter((r["user_id"], i) for r in runs if r["outcome"] != "failed" for i in r["event_ids"])
    called = {(r["user_id"], i) for r in runs if r["outcome"] != "failed" and r["turns"] > 0 for i in r["event_ids"]}
    waiting: Counter[str] = Counter()
    for e in events:
        n = ran.get((e["user_id"], e["id"]), 0)
        name = f"event {e['id']} ({e['source_id']})"
        poison = POISON in e["payload"]
        v.poison += poison
        if poison and e["status"] == "dead" and e["error"] and n == 0:
            v.poison_dead += 1
        elif poison and e["status"] in ("done", "dead"):
            v.poison_alive += 1
            v.note(f"poison alive: {name} is {e['status']} (error {e['error']!r}) in {n} runs")
        elif e["status"] == "dead":
            v.healthy_dead += 1
            v.note(f"healthy dead: {name} after {e['attempts']} attempts: {e['error']}")
        elif e["waiting"] and e["user_id"] in budgeted and n == 0:
            waiting[e["user_id"]] += 1
        elif e["status"] != "done":
            v.stuck += 1
            v.note(f"stuck: {name} is {e['status']} (error {e['error']!r})")
        elif n == 0 or (acting and (e["user_id"], e["id"]) not in called):
            v.unrun += 1
            v.note(f"unrun: {name} done without a run that {'took it' if n == 0 else 'made a model call'}")
        if n > 1:
            v.duplicated += n - 1
            v.note(f"duplicated: {name} in {n} runs")
    v.waiting, v.waiting_users = sum(waiting.values()), len(waiting)

    # Budgets: told once a UTC day (a run that crosses midnight sees the budget start again,
    # the waiting events run, and a user past it again is told again), each notice one message;
    # told today exactly the users who wait now.
    for problem in notice_problems(waiting, notices, datetime.now(UTC).date()):
        v.notices += 1
        v.note(problem)

    # No overlapping runs per user, and runs in event order.
    by_user: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_user[r["user_id"]].append(r)
    for user, user_runs in by_user.items():
        for before, after in zip(user_runs, user_runs[1:]):
            if after["started_at"] < before["finished_at"]:
                v.overlaps += 1
                v.note(f"overlap: {user} runs {before['id']} and {after['id']}")
            if before["outcome"] != "failed" and max(before["event_ids"]) > min(after["event_ids"]):
                v.misordered += 1
                v.note(f"order: {user} run {after['id']} took events older than run {before['id']}")
    # Events in the order each user sent them (a user sends the next only once acknowledged).
    seq_of = {(a.user, a.key): a.seq for a in acked}
    last: dict[str, int] = {}
    for e in events:
        seq = seq_of.get((e["user_id"], e["source_id"]))
        if seq is None:
            continue
        if seq < last.get(e["user_id"], -1):
            v.misordered += 1
            v.note(f"order: {e['source_id']} recorded after a later message of its user")
        last[e["user_id"]] = max(seq, last.get(e["user_id"], -1))

    # Background tasks: each ended and reported (its result event is checked with the events
    # above), or still open before its deadline.
    v.tasks = len(tasks)
    for t in tasks:
        if t["finished_at"] is not None and t["reported_at"] is not None:
            v.tasks_ended += 1
        elif t["open"]:
            v.tasks_open += 1
        else:
            v.tasks_bad += 1
            v.note(f"task: {t['id']} of {t['user_id']} is {t['status']}, reported {t['reported_at']}, past deadline")

    # Every message delivered, under one delivery id (copies of that id allowed).
    ids_of: dict[tuple[str, int], set[str]] = defaultdict(set)  # (user, outbox id): ids unique per shard
    copies: Counter[str] = Counter()
    for d in deliveries(logs):
        copies[d["delivery_id"]] += 1
        for m in d.get("messages", []):
            ids_of[(d["user_id"], m["id"])].add(d["delivery_id"])
    v.copies = sum(n - 1 for n in copies.values())
    for m in outbox:
        ids = ids_of.get((m["user_id"], m["id"]), set())
        if m["status"] != "delivered":
            v.stuck += 1
            v.note(f"stuck: message {m['id']} is {m['status']}")
        elif not ids:
            v.stuck += 1
            v.note(f"stuck: message {m['id']} marked delivered, never in the delivery log")
        if len(ids) > 1:
            v.duplicated += 1
            v.note(f"duplicated: message {m['id']} under delivery ids {sorted(ids)}")
    return v, {"events": events, "runs": runs}


def approvals_verdict(v: Verdict, dsns: list[str], prefix: str, answers: dict[str, Answer], keys: set[str]) -> None:
    """The approvals' promises (module doc), from the ledger's requests, the approvers'
    answers and the idempotency keys the receiver saw (an approved call's is its request id)."""
    for row in _read(dsns, Q.chaos_approvals, prefix):
        rid, standing = row["request_id"], row["answer"]
        v.approvals += 1
        ran = rid in keys
        if standing is None:
            v.approvals_bad += 1
            v.note(f"approval {rid}: neither answered nor expired (due {row['due']})")
        elif standing == "yes":
            v.approvals_yes += 1
            if not ran:
                v.approvals_bad += 1
                v.note(f"approval {rid}: approved, its call never ran")
        else:
            v.approvals_no += standing == "no"
            v.approvals_expired += standing == "expired"
            if ran:
                v.approvals_bad += 1
                v.note(f"approval {rid}: {standing}, yet its call ran")
        a = answers.get(rid)
        if a is None:
            continue  # never answered: the expiry's
        stored = 200 <= a.status < 300
        if a.status == 0:
            v.approvals_bad += 1
            v.note(f"approval {rid}: ingest never answered the {a.sent!r} sent")
        elif a.late and stored:
            v.approvals_bad += 1
            v.note(f"approval {rid}: {a.sent!r} sent after the deadline was accepted ({a.status})")
        elif stored and standing != a.sent:
            v.approvals_bad += 1
            v.note(f"approval {rid}: {a.sent!r} accepted ({a.status}), yet {standing!r} stands")
        elif not stored and not (a.status == 409 and (a.error == "expired" or a.standing == a.sent)):
            v.approvals_bad += 1
            v.note(f"approval {rid}: {a.sent!r} refused {a.status} {a.error!r} with {a.standing!r} standing")


def recovery_times(faults: list[Fault], rows: dict) -> None:
    """Each fault's recovery: from its injection to the end of the first run whose events were
    all received after it (the whole path works again: ingest, broker, worker, ledger). For a
    worker fault, the first such run of a user on a partition that worker held: the users
    whose runs had to move (another worker's users never stopped)."""
    received = {(e["user_id"], e["id"]): e["received_at"] for e in rows["events"]}
    # (oldest event of the run received, run finished, the run's partition)
    firsts: list[tuple[datetime, datetime, int]] = []
    for r in rows["runs"]:
        times = [received[(r["user_id"], i)] for i in r["event_ids"] if (r["user_id"], i) in received]
        if times and r["finished_at"] is not None:
            firsts.append((min(times), r["finished_at"], r["partition"]))
    for fault in faults:
        held = set(fault.partitions) if fault.partitions else None
        after = [
            done.timestamp()
            for got, done, partition in firsts
            if got.timestamp() >= fault.at and (held is None or partition in held)
        ]
        fault.recovery_s = (min(after) - fault.at) if after else None


# After a fault, how long its effects are counted as the fault's (beyond the restart and the
# recovery measured): a run's latency in this window is not a latency "without faults".
AFTERMATH_S = 5.0


def _p99(values: list[float]) -> str:
    if not values:
        return "- (no runs)"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]:.2f} s (n={len(ordered)})"


def notice_problems(waiting: dict[str, int], notices: list[dict], today: date) -> list[str]:
    """The users not told of their budget as promised: one notice a UTC day at most (a run
    that crosses midnight sees the budget start again, the waiting events run, and a user past
    it again is told again), each notice one outbox message, and told today exactly the users
    whose events wait now. ``notices``: ``budget_notices`` rows with ``messages``, the user's
    notice messages in the outbox (every day's)."""
    told: dict[str, list[dict]] = defaultdict(list)
    for row in notices:
        told[row["user_id"]].append(row)
    problems = []
    for user in sorted(set(waiting) | set(told)):
        rows = told.get(user, [])
        told_today = any(r["day"] == today for r in rows)
        if (user in waiting) != told_today or any(r["messages"] != len(rows) for r in rows):
            sent = [(str(r["day"]), r["messages"]) for r in rows]
            problems.append(
                f"notices: {user} has {waiting.get(user, 0)} events waiting, notices (day, messages) {sent}"
            )
    return problems


def shard_outage_line(faults: list[Fault], rows: dict, *, killed: int) -> str:
    """The other shards' users during the killed shard's outages, against no fault at all: the
    p99 of received -> run finished of their events received while shard ``killed`` was down
    (a kill-shard fault's injection to its restart), and of those whose whole way, received to
    run finished, lies outside every fault's window (injection to restart and recovery, plus
    AFTERMATH_S): an event received a second before a broker kill and finished after its
    restart waited for the fault, not for the system without faults."""
    finished = {}
    for r in rows["runs"]:
        if r["outcome"] != "failed" and r["finished_at"] is not None:
            for i in r["event_ids"]:
                finished[(r["user_id"], i)] = r["finished_at"].timestamp()
    outages = [(f.at, f.at + (f.restart_s or 0.0)) for f in faults if f.kind == "kill-shard"]
    windows = [(f.at, f.at + max(f.restart_s or 0.0, f.recovery_s or 0.0) + AFTERMATH_S) for f in faults]
    during: list[float] = []
    calm: list[float] = []
    for e in rows["events"]:
        done = finished.get((e["user_id"], e["id"]))
        if e["shard"] == killed or done is None:
            continue
        got = e["received_at"].timestamp()
        if any(start <= got <= end for start, end in outages):
            during.append(done - got)
        elif not any(got <= end and done >= start for start, end in windows):
            calm.append(done - got)
    return (
        f"shards other than {killed}: p99 received -> run finished while shard {killed} was down "
        f"{_p99(during)}; without faults {_p99(calm)}"
    )
