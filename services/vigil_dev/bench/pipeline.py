"""vigil's own figures, each measured on real ``vigil worker`` processes.

- ``record_events_per_s``: events produced to the topic and recorded in ``events`` by one
  worker, no runs. The users' home partitions are on another topic (``users`` rows written
  first), so the worker records every event exactly as it always does but no claim ever
  matches: the claim loop still wakes and queries, it just finds nothing of its own. Rate:
  events / (first produce call .. the last one's ``recorded_at``).
- ``e2e_events_per_s`` / ``e2e_runs_per_s``: record, claim, the echo agent's run, the fenced
  finish with its outbox row, for 1,000 users, at the default batch window. The workers are
  up before the first event. Short uncounted rounds search for the rate they keep up with
  (from a quarter of the record rate, half as much again while a round finished 90% of its
  offer); then each counted round offers load paced evenly over ``e2e_seconds`` at 1.25
  times the best rate seen so far, so the worker runs saturated while batches form as events
  arrive (a round that still finished 90% of its offer is not counted, and the next offers
  more). Rate: the events (runs) whose run finished from a quarter into the round until the
  last event was offered (the drain does not count).
- ``e2e_latency_p50_ms`` / ``p99``: at a fixed offered load of half ``e2e_events_per_s``, per
  event ``runs.finished_at - events.received_at`` (the producer stamps ``received_at`` when it
  hands the event over; ``finished_at`` is the finish transaction's ``now()``, a few ms before
  its commit). At the default window (which alone puts its length under every event's latency)
  and at a small one.
- ``scale_2_workers_ratio``: the e2e rounds again with a second worker process in the group.
- ``worker_rss_mb``: one worker's resident memory over a long stretch of half load spread over
  10,000 users, sampled twice a second; after a warm-up third, the growth from the second
  third to the last is ``worker_rss_growth_mb``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from datetime import UTC, datetime

import psycopg
from psycopg.rows import dict_row

from vigil_dev.bench import costs, load, statements
from vigil_dev.bench.figures import Figure, Report
from vigil_dev.bench.pgproxy import PgProxy
from vigil_dev.bench.plan import Plan
from vigil_dev.bench.procs import Workers
from vigil_dev.bench.sql import B
from vigil_dev.bench.stack import BenchStack

POLL_S = 0.05
DRAIN_TIMEOUT_S = 180.0
FOREIGN_TOPIC = "bench.elsewhere"  # the record workload's users' home: no worker owns it
SATURATE = 1.25  # offered load of a counted e2e round over the best rate seen so far
SEARCH_STEP = 1.5  # each raises the offer by this much while the last one was kept up with
KEPT_UP = 0.9  # a round finished at least this share of its offer
RSS_SAMPLE_S = 0.5
FIRST_RUN_S = 0.5  # after the batch window: poll, record, claim and finish of the first runs
MIN_ROUND_S = 2.0  # an e2e round shorter than this has no stretch left to count
RECORD_LOOK_S = 0.25  # a record round's count is looked at this often (its end is read from the ledger)


def _query(dsn: str, sql: str, params: dict | None = None) -> list[dict]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return conn.execute(sql, params).fetchall()


# -- record ------------------------------------------------------------------------------


def record(stack: BenchStack, plan: Plan, report: Report) -> Figure:
    samples = []
    with stack.ledger() as dsn, stack.topics(plan.partitions) as topics:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                B.foreign_home_users,
                {"topic": FOREIGN_TOPIC, "user_ids": [load.user_id(i, plan.users) for i in range(plan.users)]},
            )
        with Workers(stack, dsn, topics, 1) as workers:
            workers.wait_ready()
            with load.BenchProducer(stack.bootstrap, topics.events) as producer:
                for round_ in range(plan.rounds):
                    source = f"rec{round_}"
                    messages = load.encoded(plan.record_events, plan.users, source)
                    background = producer.in_thread(producer.blast, messages)
                    finished = _wait_recorded(workers, dsn, source, len(messages))
                    produced = background.result()
                    samples.append(len(messages) / (finished - produced.started))
    return report.add(Figure("record_events_per_s", samples, note=f"1 worker, {plan.users} users, no runs"))


def _wait_recorded(workers: Workers, dsn: str, source: str, count: int) -> float:
    """Wall-clock time at which the worker recorded the last of the round's ``count`` events.

    Read from the ledger once they are all there: the last batch's ``recorded_at`` (its
    transaction's ``now()``; its COPY of at most ``VIGIL_POLL_BATCH_MAX`` rows takes a few
    milliseconds more). The looks are a cheap count every ``RECORD_LOOK_S`` on a database
    connection: the end is not timed by when a look happens to see it. Timing it by scrapes of
    the worker's /metrics instead cost the worker a fifth of its interpreter time near the end
    of each round (the exposition of every metric, every 25 ms) and overshot by up to 5%.
    """
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        while True:
            row = conn.execute(B.record_round, {"source": source}).fetchone()
            if row["n"] >= count:
                return row["last_recorded"]
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"round {source}: {row['n']} of {count} events recorded within {DRAIN_TIMEOUT_S:.0f}s"
                )
            workers.check()
            time.sleep(RECORD_LOOK_S)


# -- end to end --------------------------------------------------------------------------


class EndToEnd:
    """One database and topic for the throughput, latency and scale-out rounds."""

    def __init__(self, stack: BenchStack, plan: Plan, dsn: str, topics, users: int, other_shards: tuple[str, ...] = ()):
        self.stack = stack
        self.plan = plan
        self.dsn = dsn
        # Every ledger shard the workers write to, shard 0 (``dsn``) first: a round's totals
        # are summed over them (``vigil_dev.bench.shards``).
        self.dsns = (dsn, *other_shards)
        self.topics = topics
        self.users = users
        self.producer = load.BenchProducer(stack.bootstrap, topics.events)
        self.rounds = 0
        self.window_s = plan.default_window_ms / 1000

    def _source(self, label: str) -> str:
        self.rounds += 1
        return f"{label}{self.rounds}"

    def _drain(self, workers: Workers, source: str, expected: int) -> dict:
        """Wait until every event of the round is done; its totals."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with contextlib.ExitStack() as opened:
            conns = [
                opened.enter_context(psycopg.connect(dsn, autocommit=True, row_factory=dict_row)) for dsn in self.dsns
            ]
            while time.monotonic() < deadline:
                workers.check()
                if all(self._quiet(conn) for conn in conns):
                    rows = [conn.execute(B.round_totals, {"source": source}).fetchone() for conn in conns]
                    totals = {key: sum(row[key] for row in rows) for key in ("done", "not_done", "runs")}
                    if totals["done"] >= expected:
                        return totals
                time.sleep(POLL_S)
        raise RuntimeError(f"round {source}: not all {expected} events done within {DRAIN_TIMEOUT_S:.0f}s")

    @staticmethod
    def _quiet(conn) -> bool:
        return conn.execute(B.unfinished).fetchone()["n"] == 0

    def throughput_round(self, workers: Workers, rate: float, seconds: float) -> tuple[float, float, float]:
        """Offer ``rate`` events/s for ``seconds``; (events/s, runs/s, events per run) finished.

        The rate is what finished while load was still arriving, after the first quarter of
        the round (the backlog has built up by then if the offer exceeds what the worker
        does): the drain after the last event, whose length says nothing about throughput,
        does not count.
        """
        source = self._source("e2e")
        produced = self.producer.in_thread(self.producer.paced, rate, seconds, self.users, source).result()
        # Let the round's last events reach the ledger before asking whether all are done.
        time.sleep(0.3)
        self._drain(workers, source, produced.count)
        # Nothing can finish before the batch window and the first claim: start counting
        # once the first runs could have gone through.
        skip = max(seconds / 4, self.window_s + FIRST_RUN_S)
        since = datetime.fromtimestamp(produced.started + skip, UTC)
        until = datetime.fromtimestamp(produced.started + seconds, UTC)
        rows = [_query(dsn, B.finished_between, {"since": since, "until": until})[0] for dsn in self.dsns]
        events, runs = sum(row["events"] for row in rows), sum(row["runs"] for row in rows)
        span = seconds - skip
        return events / span, runs / span, events / max(1, runs)

    def throughput(
        self, workers: Workers, start_rate: float, floor: float = 0.0
    ) -> tuple[list[float], list[float], list[float], float]:
        """Find what the workers keep up with, then measure it saturated.

        The search: short uncounted rounds from a quarter of ``start_rate`` (the record rate,
        far more than runs keep up with), the offer raised by half each time a round finished
        at least 90% of it, until one did not (or after ``plan.search_rounds``); the first
        round is a warm-up whatever it finished. Then ``rounds``
        counted rounds, each offering 1.25 times the best rate seen so far and never less
        than ``floor`` (one disturbed round, such as a rebalance still settling, must not
        make every later round offer, and so measure, almost nothing): the workers run
        saturated, a backlog forms, and the rate is what they finish while it lasts. A round
        that finished 90% of its offer or more was not saturated: it is not counted, and the
        next offers 1.25 times what it finished (at most ``rounds`` such rounds).
        """
        best = 0.0
        rate = max(floor, start_rate / 4)
        search_s = max(self.plan.e2e_seconds / 2, MIN_ROUND_S)
        for n in range(self.plan.search_rounds):
            ev, rn, batch = self.throughput_round(workers, rate, search_s)
            _progress(f"e2e search {n + 1}", rate, ev, rn, batch)
            best = max(best, ev)
            # The first round also warms the workers up (the group's first assignment, cold
            # caches): it says nothing about what they keep up with, so the search goes on.
            if n > 0 and ev < KEPT_UP * rate:
                break
            rate = max(rate, ev) * SEARCH_STEP
        events: list[float] = []
        runs: list[float] = []
        per_run: list[float] = []
        retries = self.plan.rounds
        while len(events) < self.plan.rounds:
            rate = max(floor, SATURATE * best)
            ev, rn, batch = self.throughput_round(workers, rate, self.plan.e2e_seconds)
            best = max(best, ev)
            # A round that finished its whole offer measured the offer, not the workers: when
            # the search stopped early on a disturbed round, the first counted rounds offered
            # less than the workers keep up with (1 December: 12,912 and 16,153 offered, all
            # finished, then 15,146 of 20,194; the median was an offer). Offer more instead,
            # at most ``rounds`` times.
            if ev >= KEPT_UP * rate and retries > 0:
                retries -= 1
                _progress("e2e round kept up (not counted, offering more)", rate, ev, rn, batch)
                continue
            _progress(f"e2e round {len(events) + 1}", rate, ev, rn, batch)
            events.append(ev)
            runs.append(rn)
            per_run.append(batch)
        return events, runs, per_run, max(floor, SATURATE * best)

    def latency(self, workers: Workers, rate: float) -> tuple[list[float], list[float]]:
        """Rounds at a fixed ``rate``: per round, p50 and p99 of produce-to-finished (ms)."""
        p50s, p99s = [], []
        for _ in range(self.plan.rounds):
            source = self._source("lat")
            counting = self.stack.statements and statements.reset(self.dsn)
            produced = self.producer.in_thread(
                self.producer.paced, rate, self.plan.latency_seconds, self.users, source
            ).result()
            time.sleep(0.3)
            self._drain(workers, source, produced.count)
            # The first tenth of the round is warm-up (the group may still be settling).
            since = datetime.fromtimestamp(produced.started + self.plan.latency_seconds / 10, UTC)
            ms = [row["ms"] for row in _query(self.dsn, B.round_latencies, {"source": source, "since": since})]
            p50s.append(_percentile(ms, 50))
            p99s.append(_percentile(ms, 99))
            parts = _query(self.dsn, B.round_latency_parts, {"source": source, "since": since})[0]
            runs_per_s = parts["runs"] / float(parts["span_s"])
            sweep_ms = 1000 * parts["users"] / max(runs_per_s, 1.0)
            print(
                f"  latency round: p50 {p50s[-1]:.0f} ms, p99 {p99s[-1]:.0f} ms; p50/p99 by step:"
                f" to the ledger {parts['record_p50']:.0f}/{parts['record_p99']:.0f},"
                f" to the claim {parts['claim_p50']:.0f}/{parts['claim_p99']:.0f},"
                f" the pass {parts['pass_p50']:.0f}/{parts['pass_p99']:.0f},"
                f" run and finish {parts['finish_p50']:.0f}/{parts['finish_p99']:.0f};"
                f" {runs_per_s:.0f} runs/s, a run per user every {sweep_ms:.0f} ms on average",
                file=sys.stderr,
                flush=True,
            )
            if counting:
                statements.report(self.dsn)
        return p50s, p99s


def _progress(label: str, offered: float, events: float, runs: float, per_run: float) -> None:
    print(
        f"  {label}: offered {offered:.0f} events/s, finished {events:.0f} events/s in {runs:.0f} runs/s"
        f" ({per_run:.1f} per run)",
        file=sys.stderr,
        flush=True,
    )


def _percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        raise RuntimeError("no latencies measured")
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * len(sorted_values) + 0.5) - 1))
    return float(sorted_values[index])


def end_to_end(stack: BenchStack, plan: Plan, report: Report, record_rate: float) -> None:
    with stack.ledger() as dsn, stack.topics(plan.partitions) as topics:
        e2e = EndToEnd(stack, plan, dsn, topics, plan.users)
        try:
            _end_to_end(stack, plan, report, e2e, record_rate)
        finally:
            e2e.producer.close()


def _end_to_end(stack: BenchStack, plan: Plan, report: Report, e2e: EndToEnd, record_rate: float) -> None:
    window = f"window {plan.default_window_ms} ms"
    dsn, topics = e2e.dsn, e2e.topics
    with Workers(stack, dsn, topics, 1) as workers:
        workers.wait_ready()
        events, runs, per_run, _ = e2e.throughput(workers, record_rate)
        note = f"1 worker, {plan.users} users, {window}, {statistics.median(per_run):.1f} events per run"
        one = report.add(Figure("e2e_events_per_s", events, note=note)).value
        report.add(Figure("e2e_runs_per_s", runs, note=note))
        half = one / 2
        p50, p99 = e2e.latency(workers, half)
        note = f"offered {half:.0f} events/s, 1 worker, {window}"
        report.add(Figure("e2e_latency_p50_ms", p50, note=note))
        report.add(Figure("e2e_latency_p99_ms", p99, note=note))
        # No target: where the runs are not saturated (at half load one worker is at its limit
        # in runs per second, docs/performance.md "The tail is one sweep of the round robin").
        quarter = one / 4
        p50, p99 = e2e.latency(workers, quarter)
        note = f"offered {quarter:.0f} events/s, 1 worker, {window}"
        report.add(Figure("e2e_latency_p50_ms_quarter_load", p50, note=note))
        report.add(Figure("e2e_latency_p99_ms_quarter_load", p99, note=note))
        for share in plan.latency_curve:
            p50, p99 = e2e.latency(workers, one * share)
            report.say(
                f"latency curve: {share:.2f} of e2e_events_per_s ({one * share:.0f} events/s): p50 "
                f"{statistics.median(p50):.0f} ms, p99 {statistics.median(p99):.0f} ms "
                f"(rounds {', '.join(f'{v:.0f}' for v in p99)}), {window}"
            )
        workers.add()
        workers.wait_ready()
        # Two workers are offered at least what saturates one: whatever they finish of it.
        events2, _, per_run2, _ = e2e.throughput(workers, SATURATE * one, floor=SATURATE * one)
        two = statistics.median(events2)
        report.add(
            Figure(
                "e2e_2_workers_events_per_s",
                events2,
                note=f"2 workers, {window}, {statistics.median(per_run2):.1f} events per run",
            )
        )
        report.add(
            Figure(
                "scale_2_workers_ratio", [e / one for e in events2], note=f"median {two:.0f} over {one:.0f} events/s"
            )
        )
    small = f"window {plan.small_window_ms} ms"
    with Workers(stack, dsn, topics, 1, VIGIL_BATCH_WINDOW_MS=str(plan.small_window_ms)) as workers:
        workers.wait_ready()
        p50, p99 = e2e.latency(workers, half)
        note = f"offered {half:.0f} events/s, 1 worker, {small}"
        report.add(Figure(f"e2e_latency_p50_ms_window_{plan.small_window_ms}ms", p50, note=note))
        report.add(Figure(f"e2e_latency_p99_ms_window_{plan.small_window_ms}ms", p99, note=note))


# -- memory ------------------------------------------------------------------------------


def memory(stack: BenchStack, plan: Plan, report: Report, rate: float) -> None:
    with stack.ledger() as dsn, stack.topics(plan.partitions) as topics:
        with Workers(stack, dsn, topics, 1) as workers:
            workers.wait_ready()
            worker = workers.procs[0]
            samples = []
            with load.BenchProducer(stack.bootstrap, topics.events) as producer:
                background = producer.in_thread(producer.paced, rate, plan.memory_seconds, plan.memory_users, "mem")
                while background.is_alive():
                    workers.check()
                    samples.append(worker.rss_mb())
                    time.sleep(RSS_SAMPLE_S)
                background.result()
    third = max(1, len(samples) // 3)
    settled = samples[third:]
    middle, last = samples[third : 2 * third], samples[2 * third :]
    note = f"{plan.memory_users} users, {rate:.0f} events/s for {plan.memory_seconds:.0f} s"
    report.add(Figure("worker_rss_mb", settled, per="samples after warm-up", note=note))
    growth = statistics.median(last) - statistics.median(middle or last)
    report.add(
        Figure(
            "worker_rss_growth_mb",
            [growth],
            per="run",
            note=f"median of the last third minus the middle third; start {samples[0]:.0f} MB",
        )
    )


# -- single-event runs -------------------------------------------------------------------


def single_event_runs(stack: BenchStack, plan: Plan, report: Report, start_rate: float) -> None:
    """``e2e_single_event_runs_per_s``: the e2e rounds with every run carrying one event, so
    the figure is what a run costs, not an event: ``plan.memory_users`` users (a user's next
    event comes seconds after its last) and ``VIGIL_BATCH_MAX=1`` (a user's events that did
    pile up still go one per run). Then, on the same worker at half that rate, the per-run
    cost counters (``vigil_dev.bench.costs``)."""
    with stack.ledger() as dsn, stack.topics(plan.partitions) as topics:
        e2e = EndToEnd(stack, plan, dsn, topics, plan.memory_users)
        try:
            with Workers(stack, dsn, topics, 1, VIGIL_BATCH_MAX="1") as workers:
                workers.wait_ready()
                _, runs, per_run, _ = e2e.throughput(workers, start_rate)
                note = (
                    f"1 worker, {plan.memory_users} users, window {plan.default_window_ms} ms, VIGIL_BATCH_MAX=1, "
                    f"{statistics.median(per_run):.2f} events per run"
                )
                report.add(Figure("e2e_single_event_runs_per_s", runs, note=note))
                rate = statistics.median(runs) / 2
                grown, _, finished = costs.measure(e2e, workers, rate)
                note = f"{finished} single-event runs, {rate:.0f} events/s offered to {plan.memory_users} users"
                costs.add_figures(report, "run", grown, finished, note)
        finally:
            e2e.producer.close()


# -- cost per event ----------------------------------------------------------------------


def per_event_costs(stack: BenchStack, plan: Plan, report: Report, rate: float) -> None:
    """The per-event cost counters (``vigil_dev.bench.costs``) at ``rate`` over ``plan.users``."""
    with stack.ledger() as dsn, stack.topics(plan.partitions) as topics:
        e2e = EndToEnd(stack, plan, dsn, topics, plan.users)
        try:
            with Workers(stack, dsn, topics, 1) as workers:
                workers.wait_ready()
                grown, events, runs = costs.measure(e2e, workers, rate)
        finally:
            e2e.producer.close()
    note = f"{events} events in {runs} runs ({events / max(runs, 1):.1f} per run), {rate:.0f} events/s offered"
    costs.add_figures(report, "event", grown, events, note)


# -- a database across a network ---------------------------------------------------------

# Added to each direction of every worker-to-PostgreSQL byte (a round trip then takes about a
# millisecond more, plus the relay's own hop and its timer's granularity: the figure
# remote_db_round_trip_ms says what it came to).
REMOTE_DB_DELAY_MS = 0.5
REMOTE_DB_FIGURES = [
    "remote_db_round_trip_ms",
    "remote_db_round_trips_per_run",
    "e2e_latency_p50_ms_remote_db",
    "e2e_latency_p99_ms_remote_db",
]


def _round_trip_ms(dsn: str, count: int = 50) -> list[float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT 1").fetchone()
        taken = []
        for _ in range(count):
            began = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            taken.append((time.perf_counter() - began) * 1000)
    return taken


def remote_db(stack: BenchStack, plan: Plan, report: Report, rate: float) -> None:
    """The quarter-load latency rounds with the worker's ledger connections through a relay
    that delays every byte (:mod:`vigil_dev.bench.pgproxy`): what a database across a network
    adds, and how many round trips a run costs (the relay counts them; the claim pass, the
    finish group and the recorded batch each wait out theirs in series). No targets."""
    with (
        stack.ledger() as dsn,
        stack.topics(plan.partitions) as topics,
        PgProxy(dsn, REMOTE_DB_DELAY_MS) as proxy,
    ):
        e2e = EndToEnd(stack, plan, dsn, topics, plan.users)
        try:
            rtt = _round_trip_ms(proxy.dsn)
            note = f"SELECT 1 through the relay, {len(rtt)} times; {REMOTE_DB_DELAY_MS} ms added each way"
            report.add(Figure("remote_db_round_trip_ms", [statistics.median(rtt)], per="median", note=note))
            with Workers(stack, proxy.dsn, topics, 1) as workers:
                workers.wait_ready()
                # Warm-up, not counted: the worker's first seconds (its pool, prepared statements).
                source = e2e._source("warm")
                produced = e2e.producer.in_thread(e2e.producer.paced, rate, 3.0, e2e.users, source).result()
                e2e._drain(workers, source, produced.count)
                before, runs_before = proxy.round_trips(), _runs(dsn)
                p50, p99 = e2e.latency(workers, rate)
                trips, runs = proxy.round_trips() - before, _runs(dsn) - runs_before
        finally:
            e2e.producer.close()
    note = f"offered {rate:.0f} events/s, 1 worker, window {plan.default_window_ms} ms, ledger through the relay"
    report.add(
        Figure("remote_db_round_trips_per_run", [trips / max(runs, 1)], per="count", note=f"{runs} runs; {note}")
    )
    report.add(Figure("e2e_latency_p50_ms_remote_db", p50, note=note))
    report.add(Figure("e2e_latency_p99_ms_remote_db", p99, note=note))


def _runs(dsn: str) -> int:
    return int(_query(dsn, B.runs_count, {})[0]["n"])
