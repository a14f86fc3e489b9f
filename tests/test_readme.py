"""The README is a first screen; its reference lives in docs/ and is kept true by these tests.

docs/settings.md's table is `vigil config`'s (generated); docs/metrics.md names every metric the
product defines and nothing else; every relative link of the README and docs/ resolves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from vigil.ops.config import SETTINGS_CLASSES
from vigil.settings import settings_table

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PRODUCT = REPO / "services" / "vigil"
METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary"}
README_MAX_LINES = 450


def test_configuration_table_is_current():
    text = (DOCS / "settings.md").read_text()
    block = re.search(r"<!-- config:start -->\n(.*?)<!-- config:end -->", text, re.S)
    assert block, "docs/settings.md lacks the config markers"
    assert block.group(1).strip() == settings_table(SETTINGS_CLASSES).strip(), (
        "docs/settings.md's configuration table is stale: run `python -m vigil.readme` to write it "
        "(or paste `vigil config` between the markers)"
    )


def test_quick_start_is_two_commands():
    text = README.read_text()
    quick = re.search(r"## Quick start\n(.*?)\n## ", text, re.S).group(1)
    commands = re.search(r"```sh\n(.*?)```", quick, re.S).group(1).strip().splitlines()
    assert [c.split("#")[0].strip() for c in commands] == ["make up", "make test"]


def test_readme_is_a_first_screen_with_contents():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "## Contents" in text


def defined_metrics() -> set[str]:
    """Every metric name a product module passes to prometheus_client, as Prometheus exposes it."""
    names = set()
    for path in PRODUCT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and len(node.args) >= 2):
                continue  # a metric always has a name and a documentation string
            func = node.func
            kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            first = node.args[0]
            if kind in METRIC_TYPES and isinstance(first, ast.Constant) and isinstance(first.value, str):
                name = first.value
                names.add(f"{name}_total" if kind == "Counter" and not name.endswith("_total") else name)
    return names


def test_metrics_table_names_every_metric_and_no_other():
    rows = re.findall(r"^\| `(vigil_\w+)`(?:, `(vigil_\w+)`)?", (DOCS / "metrics.md").read_text(), re.M)
    documented_names = {name for row in rows for name in row if name}
    defined = defined_metrics()
    assert defined, "no metric found: the scan is broken"
    assert defined - documented_names == set(), "metrics missing from docs/metrics.md"
    assert documented_names - defined == set(), "docs/metrics.md lists metrics no module defines"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_every_relative_link_resolves():
    broken = []
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_every_dev_stack_setting_is_in_the_settings_page():
    from vigil_dev.cli import DEV_SETTINGS

    text = (DOCS / "settings.md").read_text()
    section = text.split("## The dev stack's settings", 1)[-1]
    missing = [name for name in (*DEV_SETTINGS, "VIGIL_DEV_ADMIN_DATABASE_URL") if f"`{name}`" not in section]
    assert not missing, f"docs/settings.md, 'The dev stack's settings', lacks {missing}"
