"""promtool and prometheus for the tests: built once per machine from the Prometheus Go
module (deploy/tools/build-prometheus.sh caches them under ~/.cache/vigil/tools), plus what
the tests read from the rule files and the dashboard.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "vigil.rules.yaml"
RULE_TESTS = PROMETHEUS_DIR / "rules.test.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "vigil.json"
OPERATIONS = REPO / "docs" / "operations.md"
BUILD = REPO / "deploy" / "tools" / "build-prometheus.sh"

# A first build on a fresh 2-core machine takes minutes (see deploy/tools/build-prometheus.sh).
BUILD_TIMEOUT_S = 1500


def prometheus_tools() -> Path:
    """The folder holding ``promtool`` and ``prometheus``, built on first use."""
    done = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{BUILD} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alert_rules() -> list[dict]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def recording_rules() -> list[dict]:
    return [rule for group in rule_groups() for rule in group["rules"] if "record" in rule]


def dashboard_panels() -> list[dict]:
    """Every panel with targets in the dashboard, rows included (collapsed rows nest theirs)."""
    import json

    out = []

    def walk(panels):
        for panel in panels:
            if panel.get("targets"):
                out.append(panel)
            walk(panel.get("panels", []))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


# What Grafana puts for each dashboard variable a query uses when every value is picked ("All").
ALL_VALUES = {"shard": ".*"}


def with_variables(expr: str) -> str:
    """A panel's query as Grafana sends it with every variable at "All", for a real Prometheus."""
    return re.sub(r"\$(\w+)", lambda m: ALL_VALUES[m.group(1)], expr)


def with_annotations(tests: dict) -> dict:
    """The unit-test file with each expected alert's annotations filled in from the rule file.

    promtool compares annotations exactly; writing them twice by hand would make every edit of
    a summary an edit of the tests. The one template vigil's annotations use, ``{{ $labels.X }}``,
    is filled from the expected alert's labels, so promtool checks that it names the right one.
    """
    annotations = {rule["alert"]: rule.get("annotations", {}) for rule in alert_rules()}
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            for expected in check.get("exp_alerts") or []:
                labels = expected.get("exp_labels", {})
                expected["exp_annotations"] = {
                    key: _fill_labels(text, labels) for key, text in annotations[check["alertname"]].items()
                }
    return tests


LABEL_TEMPLATE = re.compile(r"\{\{ \$labels\.([a-z_]+) \}\}")


def _fill_labels(text: str, labels: dict) -> str:
    return LABEL_TEMPLATE.sub(lambda m: str(labels[m.group(1)]), text)


METRIC_NAME = re.compile(r"\b(vigil_[a-z0-9_]+)\b")


def metric_names(expr: str) -> set[str]:
    """Raw vigil metric names an expression reads (recording rule names contain colons)."""
    return {m for m in METRIC_NAME.findall(expr)}
