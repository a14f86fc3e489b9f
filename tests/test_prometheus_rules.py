"""The alert and recording rules in deploy/prometheus: valid, unit-tested with promtool,
reading only metrics the services export, each alert with a runbook section, and the
PrometheusRule manifest carrying exactly the rule file's groups.

promtool is built once per machine from the Prometheus Go module (the first run of this
module takes minutes on 2 cores; later runs take seconds).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from prometheus_support import (
    DASHBOARD,
    OPERATIONS,
    PROMETHEUS_DIR,
    RULE_TESTS,
    RULES,
    alert_rules,
    metric_names,
    prometheus_tools,
    recording_rules,
    with_annotations,
)

pytestmark = pytest.mark.tools  # promtool, Go-built: `make test` runs these after the parallel phase


@pytest.fixture(scope="module")
def promtool():
    return prometheus_tools() / "promtool"


def exported_metric_names() -> set[str]:
    """Every sample name vigil's services can export, read from the registry's exposition."""
    from prometheus_client import REGISTRY, generate_latest

    import vigil.agent.metrics  # noqa: F401  (each import registers its service's metrics)
    import vigil.dispatcher.metrics  # noqa: F401
    import vigil.ingest.metrics  # noqa: F401
    import vigil.scheduler.metrics  # noqa: F401
    import vigil.worker.metrics  # noqa: F401

    names = set()
    for line in generate_latest(REGISTRY).decode().splitlines():
        parts = line.split()
        if line.startswith("# TYPE ") and parts[2].startswith("vigil_"):
            name, kind = parts[2], parts[3]
            if kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            elif kind == "histogram":
                names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
            else:
                names.add(name)
    return names


def test_manifest_matches_the_rule_file():
    done = subprocess.run(
        [sys.executable, str(PROMETHEUS_DIR / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    manifest = yaml.safe_load((PROMETHEUS_DIR / "vigil-prometheusrule.yaml").read_text())
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_rules_read_only_metrics_that_exist():
    exported = exported_metric_names()
    assert "vigil_runs_total" in exported and "vigil_run_duration_seconds_bucket" in exported
    for rule in alert_rules() + recording_rules():
        unknown = metric_names(rule["expr"]) - exported
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads metrics no service exports: {unknown}"
    from prometheus_support import dashboard_panels

    records = {rule["record"] for rule in recording_rules()}
    for panel in dashboard_panels():
        for target in panel["targets"]:
            unknown = metric_names(target["expr"]) - exported
            assert not unknown, f"panel {panel['title']!r} reads metrics no service exports: {unknown}"
            for record in re.findall(r"\bvigil:[a-z0-9_:]+", target["expr"]):
                assert record in records, f"panel {panel['title']!r} reads {record}, which no rule records"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_alert_has_a_runbook_section():
    anchors = _anchors(OPERATIONS.read_text())
    for rule in alert_rules():
        url = rule["annotations"]["runbook"]
        # runbook_url: the same link, under the name Alertmanager and Grafana templates use.
        assert rule["annotations"]["runbook_url"] == url, rule["alert"]
        page, _, anchor = url.partition("#")
        assert page == "docs/operations.md", rule["alert"]
        assert anchor == rule["alert"].lower() and anchor in anchors, f"no section for {rule['alert']} ({url})"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]


def test_promtool_checks_the_rule_files(promtool):
    for path in (RULES, PROMETHEUS_DIR / "vigil-prometheusrule.yaml"):
        if path.name.startswith("vigil-prometheusrule"):
            # promtool reads plain rule files: check the manifest's spec as one.
            text = yaml.safe_dump(yaml.safe_load(path.read_text())["spec"])
            path = PROMETHEUS_DIR / ".manifest-spec.tmp.yaml"
            path.write_text(text)
        try:
            done = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True)
        finally:
            if path.name.startswith(".manifest-spec"):
                path.unlink()
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


def test_every_alert_is_unit_tested_both_ways():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired, quiet = set(), set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - fired == set(), "alerts no test expects to fire"
    assert names - quiet == set(), "alerts no test expects to stay quiet"


def test_promtool_unit_tests_pass(promtool, tmp_path):
    tests = with_annotations(yaml.safe_load(RULE_TESTS.read_text()))
    tests["rule_files"] = [str(RULES)]
    filled = tmp_path / "rules.test.yaml"
    filled.write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", filled], capture_output=True, text=True)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_dashboard_is_generated_and_well_formed():
    from prometheus_support import DASHBOARD, dashboard_panels

    done = subprocess.run(
        [sys.executable, str(DASHBOARD.parent / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert metric_names(target["expr"]) or "vigil:" in target["expr"] or "up{" in target["expr"], target


def test_the_budgets_row_shows_spend_against_each_profiles_budget():
    """The budgets row reads the budget itself (vigil_budget_tokens{profile}) and divides the
    profile's billed tokens of the last 24 hours by it: spend against budget, per profile."""
    dashboard = json.loads(DASHBOARD.read_text())
    [row] = [p for p in dashboard["panels"] if p["type"] == "row" and p["title"].startswith("budgets")]
    exprs = [target["expr"] for panel in row["panels"] for target in panel["targets"]]
    assert any(metric_names(e) == {"vigil_budget_tokens"} for e in exprs), exprs
    against = [e for e in exprs if "vigil_model_tokens_total" in e and "vigil_budget_tokens" in e]
    assert against and all("/" in e and "on (profile)" in e for e in against), exprs


def test_the_shards_row_shows_each_picked_shard():
    """The ledger shards row: every query keeps the `shard` label and reads only the shards the
    dashboard's `shard` variable picks, whose values are the shards the schedulers report on."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    shard = variables["shard"]
    assert shard["includeAll"] and shard["multi"] and shard["allValue"] == ".*"
    assert shard["query"]["query"] == "label_values(vigil_scheduler_shard_up, shard)"
    assert "vigil_scheduler_shard_up" in exported_metric_names()
    [row] = [p for p in dashboard["panels"] if p["type"] == "row" and p["title"].startswith("ledger shards")]
    exprs = [target["expr"] for panel in row["panels"] for target in panel["targets"]]
    assert len(exprs) >= 8, exprs
    for expr in exprs:
        assert 'shard=~"$shard"' in expr and ("by (shard)" in expr or "vigil:" in expr), expr
    for name in (
        "vigil_scheduler_shard_up",
        "vigil_dispatcher_shard_up",
        "vigil:outbox_oldest_age_seconds:max",
        "vigil_worker_shard_partitions",
    ):
        assert any(name in expr for expr in exprs), name
    # Every variable any panel uses is defined, and the live test knows its "All" value.
    from prometheus_support import ALL_VALUES, dashboard_panels

    used = {v for panel in dashboard_panels() for t in panel["targets"] for v in re.findall(r"\$(\w+)", t["expr"])}
    assert used <= set(variables) and used <= set(ALL_VALUES), used
