"""The product package ships without its tooling: ``vigil`` imports nothing from ``vigil_dev``.

The dev stack, the demo, the scripted Messages API, the benchmarks and the chaos run live in
``vigil_dev`` beside the product (docs/architecture.md, "Layout"); an image built from the
product must not need them, so no product module may import them, however deep.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PRODUCT = Path(__file__).resolve().parents[1] / "services" / "vigil"


def test_importing_every_product_module_loads_no_tooling():
    script = """
import importlib, pkgutil, sys
import vigil
for info in pkgutil.walk_packages(vigil.__path__, "vigil."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
loaded = sorted(name for name in sys.modules if name == "vigil_dev" or name.startswith("vigil_dev."))
print(len([n for n in sys.modules if n.startswith("vigil.")]), loaded)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.strip().split(" ", 1)
    assert int(count) > 50  # every product module was imported, not an empty walk
    assert loaded == "[]", f"product modules pulled in tooling: {loaded}"


def test_plain_import_vigil_loads_no_tooling():
    script = "import sys, vigil; print(sorted(m for m in sys.modules if m.startswith('vigil_dev')))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_no_product_source_names_the_tooling_package():
    """Also the imports a walk would not run (inside functions, behind a condition)."""
    offenders = []
    for path in PRODUCT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value.startswith("vigil_dev.") else []
            offenders += [
                f"{path.relative_to(PRODUCT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "vigil_dev"
            ]
    assert offenders == []
