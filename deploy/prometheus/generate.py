"""Write vigil-prometheusrule.yaml from vigil.rules.yaml: the same groups, wrapped in a
PrometheusRule for the Prometheus Operator.

    python deploy/prometheus/generate.py          # rewrite the manifest
    python deploy/prometheus/generate.py --check  # exit 1 if the manifest is out of date

tests/test_prometheus_rules.py runs the check, so an edit to the rule file that was not
carried over fails the build.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE / "vigil.rules.yaml"
MANIFEST = HERE / "vigil-prometheusrule.yaml"
HEADER = "# Generated from vigil.rules.yaml by deploy/prometheus/generate.py: edit that file, then rerun this.\n"


def manifest_text() -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "vigil", "labels": {"app.kubernetes.io/part-of": "vigil"}},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=120)


def main(argv: list[str]) -> int:
    text = manifest_text()
    if "--check" in argv:
        if not MANIFEST.exists() or MANIFEST.read_text() != text:
            print(f"{MANIFEST} is out of date: run python deploy/prometheus/generate.py", file=sys.stderr)
            return 1
        return 0
    MANIFEST.write_text(text)
    print(f"wrote {MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
