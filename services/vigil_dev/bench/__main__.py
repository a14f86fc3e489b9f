"""``python -m vigil_dev.bench [--quick]``: every figure, then the ratios against the targets.

Exit status 0 when every figure was produced (speed is reported, never asserted), 1 when a
workload failed (its figures print as ``pending`` with the reason), 2 when no stack could be
had at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
import traceback

from vigil.settings import load
from vigil.worker.settings import WorkerSettings
from vigil_dev.bench import (
    costs,
    dispatch,
    ingest_http,
    model_bound,
    pipeline,
    raw,
    rebalance,
    retention,
    river,
    rolling,
    shards,
)
from vigil_dev.bench.figures import Figure, Report, fmt
from vigil_dev.bench.plan import FULL, QUICK, Plan
from vigil_dev.bench.stack import BenchStack

FIGURES = [
    "raw_kafka_events_per_s",
    "raw_pg_rows_per_s",
    "record_events_per_s",
    "e2e_events_per_s",
    "e2e_runs_per_s",
    "e2e_latency_p50_ms",
    "e2e_latency_p99_ms",
    "e2e_latency_p50_ms_window_{small}ms",
    "e2e_latency_p99_ms_window_{small}ms",
    "e2e_latency_p50_ms_quarter_load",
    "e2e_latency_p99_ms_quarter_load",
    "e2e_2_workers_events_per_s",
    "scale_2_workers_ratio",
    "e2e_single_event_runs_per_s",
    *river.FIGURES,
    "trivial_http_requests_per_s",
    "ingest_http_events_per_s",
    "ingest_http_batched_events_per_s",
    "ingest_http_ratio",
    "ingest_http_batched_ratio",
    "worker_rss_mb",
    "worker_rss_growth_mb",
    "retention_drop_day_s",
    *dispatch.FIGURES,
    *[f"cost_{name}_per_{unit}" for unit in ("event", "run") for name in costs.COUNTERS],
    *shards.FIGURES,
    *pipeline.REMOTE_DB_FIGURES,
    *model_bound.FIGURES,
    *rebalance.FIGURES,
    *rolling.FIGURES,
]
WORKLOADS = [
    "raw_kafka",
    "raw_pg",
    "record",
    "e2e",
    "single",
    "river",
    "memory",
    "ingest",
    "retention",
    "dispatch",
    "costs",
    "shards",
    "remote_db",
    "model_bound",
    "rebalance",
    "rolling",
]
# "Memory flat": growth after warm-up within this share of the resident size (allocator noise).
FLAT_SHARE = 0.05
FALLBACK_RATE = 1000.0  # events/s for a workload whose input figure failed


def figure_names(plan: Plan) -> list[str]:
    """The figures ``plan`` prints: River's only where it runs (not in ``--quick``)."""
    skipped = river.FIGURES if plan.river_seconds <= 0 else []
    return [name.format(small=plan.small_window_ms) for name in FIGURES if name not in skipped]


def _phase(report: Report, workload: str, names: list[str], action) -> None:
    """Run one workload; if it fails, its figures that are still missing print as pending."""
    began = time.monotonic()
    try:
        action()
    except Exception as exc:  # one failed workload must not hide the others' figures
        traceback.print_exc(file=sys.stderr)
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        for name in names:
            if name not in report.figures:
                report.add(Figure(name, pending=f"failed: {reason}"))
    finally:
        # Where a run's minutes go: the figures do not say, and `make test` pays for them.
        report.say(f"workload {workload}: {time.monotonic() - began:.1f} s")


def _worker_settings(report: Report) -> WorkerSettings:
    settings = load(WorkerSettings)
    report.say(
        "worker settings: "
        f"VIGIL_RUN_CONCURRENCY={settings.run_concurrency} VIGIL_BATCH_MAX={settings.batch_max} "
        f"VIGIL_POLL_BATCH_MAX={settings.poll_batch_max} VIGIL_FINISH_BATCH_MAX={settings.finish_batch_max} "
        f"VIGIL_FINISH_CONCURRENCY={settings.finish_concurrency} VIGIL_CLAIM_PASS_MAX={settings.claim_pass_max} "
        f"VIGIL_DB_POOL_MAX={settings.db_pool_max} VIGIL_SCAN_INTERVAL_S={settings.scan_interval_s} "
        f"VIGIL_BATCH_WINDOW_MS={settings.batch_window_ms} (bench default; the small-window latency sets its own)"
    )
    return settings


def summary(report: Report, plan: Plan) -> None:
    v = report.value
    report.say("")
    report.say("summary (ratios against the targets, medians of this run):")

    def line(label: str, value: float | None, text: str, met: bool | None) -> None:
        verdict = "no value" if value is None else ("met" if met else "MISSED") if met is not None else "info"
        report.say(f"  {label}: {text} -> {verdict}")

    kafka, pg, rec = v("raw_kafka_events_per_s"), v("raw_pg_rows_per_s"), v("record_events_per_s")
    if None not in (kafka, pg, rec):
        ratio = rec / min(kafka, pg)
        line(
            "record_vs_raw",
            ratio,
            f"record {fmt(rec)} / min(raw_kafka {fmt(kafka)}, raw_pg {fmt(pg)}) = {ratio:.2f} (target >= 0.50)",
            ratio >= 0.5,
        )
    else:
        line("record_vs_raw", None, "missing input", None)
    e2e = v("e2e_events_per_s")
    if None not in (e2e, pg):
        ratio = e2e / pg
        line("e2e_vs_raw_pg", ratio, f"e2e {fmt(e2e)} / raw_pg {fmt(pg)} = {ratio:.2f} (target >= 0.25)", ratio >= 0.25)
    else:
        line("e2e_vs_raw_pg", None, "missing input", None)
    single = v("e2e_single_event_runs_per_s")
    if None not in (single, pg):
        ratio = single / pg
        line(
            "single_event_runs_vs_raw_pg",
            ratio,
            f"single-event runs {fmt(single)} / raw_pg {fmt(pg)} = {ratio:.3f} (target >= 0.05)",
            ratio >= 0.05,
        )
    else:
        line("single_event_runs_vs_raw_pg", None, "missing input", None)
    river.summary(report, plan, line)
    p99, p99_small = v("e2e_latency_p99_ms"), v(f"e2e_latency_p99_ms_window_{plan.small_window_ms}ms")
    if p99 is not None:
        line(
            f"latency_p99_window_{plan.default_window_ms}ms",
            p99,
            f"{fmt(p99)} ms at half load, default window {plan.default_window_ms} ms (target < 250)",
            p99 < 250,
        )
    if p99_small is not None:
        line(
            f"latency_p99_window_{plan.small_window_ms}ms",
            p99_small,
            f"{fmt(p99_small)} ms at half load, window {plan.small_window_ms} ms (target < 250)",
            p99_small < 250,
        )
    p99_quarter = v("e2e_latency_p99_ms_quarter_load")
    if p99_quarter is not None:
        line(
            "latency_p99_quarter_load",
            p99_quarter,
            f"{fmt(p99_quarter)} ms at a quarter load, default window (no target: runs not saturated)",
            None,
        )
    ratio = v("ingest_http_ratio")
    line(
        "ingest_vs_trivial",
        ratio,
        f"{ratio:.2f} single-event POSTs per trivial GET (target >= 0.50)" if ratio is not None else "missing",
        None if ratio is None else ratio >= 0.5,
    )
    growth, rss = v("worker_rss_growth_mb"), v("worker_rss_mb")
    if None not in (growth, rss):
        line(
            "memory_flat",
            growth,
            f"growth {growth:+.1f} MB after warm-up at {fmt(rss)} MB (target: within {FLAT_SHARE:.0%})",
            growth <= FLAT_SHARE * rss,
        )
    drop = v("retention_drop_day_s")
    line(
        "retention_drop_day",
        drop,
        f"{drop:.2f} s to drop a day of events, dedup keys kept (target < 1 s)" if drop is not None else "missing",
        None if drop is None else drop < 1.0,
    )
    dispatched, runs = v("dispatch_deliveries_per_s"), v("e2e_runs_per_s")
    if dispatched is not None:
        against = f", {dispatched / runs:.2f} x e2e_runs_per_s {fmt(runs)}" if runs else ""
        line(
            "dispatch",
            dispatched,
            f"{fmt(dispatched)} deliveries/s by one dispatcher{against} (no target: each echo run writes one message)",
            None,
        )
    scale = v("scale_2_workers_ratio")
    line(
        "scale_2_workers",
        scale,
        f"{scale:.2f} x one worker (no target; 2 cores shared with broker, database, producer)" if scale else "missing",
        None,
    )
    shards.summary(report, line)
    model_bound.summary(report, line)
    rebalance.summary(report, line)
    rolling.summary(report, line)


def run(plan: Plan, keep_logs: bool, only: set[str] | None = None, statements: bool = False) -> int:
    began = time.monotonic()
    report = Report()
    with BenchStack.open(keep_logs=keep_logs, statements=statements) as stack:
        report.say(f"vigil bench ({plan.name}): {plan.rounds} measured round(s) per figure")
        for text in stack.machine():
            report.say(text)
        report.durability = stack.durability()
        settings = _worker_settings(report)
        if keep_logs:
            report.say(f"logs: {stack.workdir}")
        report.say("")
        workloads = {
            "raw_kafka": (["raw_kafka_events_per_s"], lambda: raw.raw_kafka(stack, plan, report)),
            "raw_pg": (["raw_pg_rows_per_s"], lambda: raw.raw_pg(stack, plan, report, settings.poll_batch_max)),
            "record": (["record_events_per_s"], lambda: pipeline.record(stack, plan, report)),
            "e2e": (
                [n for n in figure_names(plan) if n.startswith(("e2e_", "scale_")) and "single" not in n],
                lambda: pipeline.end_to_end(stack, plan, report, report.value("record_events_per_s") or FALLBACK_RATE),
            ),
            "single": (
                ["e2e_single_event_runs_per_s", *[n for n in figure_names(plan) if n.endswith("_per_run")]],
                lambda: pipeline.single_event_runs(
                    stack, plan, report, report.value("e2e_runs_per_s") or FALLBACK_RATE / 2
                ),
            ),
            # The peer, right after vigil's figures it is compared with: the same hour, the same neighbours.
            "river": (river.FIGURES, lambda: river.river(stack, plan, report)),
            "memory": (
                ["worker_rss_mb", "worker_rss_growth_mb"],
                lambda: pipeline.memory(stack, plan, report, (report.value("e2e_events_per_s") or FALLBACK_RATE) / 2),
            ),
            "ingest": (
                [n for n in figure_names(plan) if "http" in n],
                lambda: ingest_http.ingest_http(stack, plan, report),
            ),
            "retention": (["retention_drop_day_s"], lambda: retention.drop_day(stack, plan, report)),
            "dispatch": (dispatch.FIGURES, lambda: dispatch.dispatch(stack, plan, report)),
            # Half load of the e2e shape: the counts, not the rate, are the figures.
            "costs": (
                [n for n in figure_names(plan) if n.startswith("cost_") and n.endswith("_per_event")],
                lambda: pipeline.per_event_costs(
                    stack, plan, report, (report.value("e2e_events_per_s") or FALLBACK_RATE) / 2
                ),
            ),
            # Two ledger shards on two servers: the e2e search from the record rate, and the cost
            # passes at what the one-shard passes were offered.
            "shards": (
                shards.FIGURES,
                lambda: shards.two_shards(
                    stack,
                    plan,
                    report,
                    report.value("record_events_per_s") or FALLBACK_RATE,
                    (report.value("e2e_events_per_s") or FALLBACK_RATE) / 2,
                    (report.value("e2e_single_event_runs_per_s") or FALLBACK_RATE) / 2,
                ),
            ),
            # A quarter of the e2e rate (below the knee: what the network adds, not the queue).
            "remote_db": (
                pipeline.REMOTE_DB_FIGURES,
                lambda: pipeline.remote_db(
                    stack, plan, report, (report.value("e2e_events_per_s") or FALLBACK_RATE) / 4
                ),
            ),
            "model_bound": (model_bound.FIGURES, lambda: model_bound.model_bound(stack, plan, report)),
            "rebalance": (rebalance.FIGURES, lambda: rebalance.rebalance(stack, plan, report)),
            "rolling": (rolling.FIGURES, lambda: rolling.rolling(stack, plan, report)),
        }
        for name, (figures, action) in workloads.items():
            if only is None or name in only:
                _phase(report, name, figures, action)
        summary(report, plan)
        load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
        report.say(f"\nload average at end: {load_avg}; took {time.monotonic() - began:.0f} s")
    missing = report.missing([n for n in figure_names(plan) if only is None or n in report.figures])
    if missing:
        report.say(f"figures without a value: {', '.join(missing)}")
        return 1
    return 0


def _interrupt_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the bench still stops its processes and drops its
    databases and topics."""

    def handler(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    _interrupt_on_sigterm()
    parser = argparse.ArgumentParser(prog="python -m vigil_dev.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads (smoke check, under 2 minutes)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (path printed)")
    parser.add_argument(
        "--statements",
        action="store_true",
        help="load pg_stat_statements in the bench's PostgreSQL and print each latency round's costliest statements",
    )
    parser.add_argument("--only", help="comma-separated workloads to run: " + ", ".join(WORKLOADS))
    parser.add_argument(
        "--latency-curve",
        metavar="SHARES",
        help="with the e2e workload: latency rounds at these shares of e2e_events_per_s too, comma-separated "
        "(e.g. 0.3,0.35,0.4,0.45), each printed as a line 'latency curve: ...' (no figures)",
    )
    args = parser.parse_args(argv)
    try:
        curve = tuple(float(x) for x in args.latency_curve.split(",")) if args.latency_curve else ()
    except ValueError:
        parser.error(f"--latency-curve: comma-separated numbers, not {args.latency_curve!r}")
    if any(not 0 < share <= 2 for share in curve):
        parser.error("--latency-curve: each share between 0 (excluded) and 2")
    only = set(args.only.split(",")) if args.only else None
    if only and not only <= set(WORKLOADS):
        parser.error(f"unknown workload(s): {', '.join(sorted(only - set(WORKLOADS)))}")
    try:
        plan = dataclasses.replace(QUICK if args.quick else FULL, latency_curve=curve)
        return run(plan, args.keep_logs, only, args.statements)
    except Exception as exc:
        traceback.print_exc()
        print(f"bench: stopped: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
