"""The product's layout (docs/architecture.md, "Layout").

The product package ships without its tooling: ``vigil`` imports nothing from ``vigil_dev``.
The dev stack, the demo, the scripted Messages API, the benchmarks and the chaos run live in
``vigil_dev`` beside the product; an image built from the product must not need them, so no
product module may import them, however deep.

Wiring is explicit: no cycle between the product's modules (counting every import, those
inside functions too), and no import inside a function but the few deliberate ones.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import grimp

PRODUCT = Path(__file__).resolve().parents[1] / "services" / "vigil"

# The imports inside functions the product keeps on purpose, each for a heavy dependency that
# only some deployments use (the reason is commented at the import).
DELIBERATE_LATE_IMPORTS = {
    ("agent/__init__.py", "vigil.agent.claude"),  # the Anthropic SDK: VIGIL_AGENT=claude only
    ("bus/codec.py", "confluent_kafka.schema_registry"),  # VIGIL_SCHEMA_REGISTRY_URL only
    ("bus/codec.py", "confluent_kafka.schema_registry.avro"),
    # The OpenTelemetry SDK, exporter and instrumentations: only with an OTLP endpoint set.
    *(
        ("tracing.py", f"opentelemetry.{module}")
        for module in (
            "exporter.otlp.proto.http.trace_exporter",
            "instrumentation",
            "instrumentation.aiohttp_client",
            "instrumentation.asgi",
            "instrumentation.httpx",
            "instrumentation.psycopg",
            "sdk.resources",
            "sdk.trace",
            "sdk.trace.export",
            "sdk.trace.sampling",
        )
    ),
}


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


def import_cycle(package: str) -> list[str] | None:
    """One cycle among ``package``'s modules, ``[a, b, ..., a]`` where each imports the next, or None.

    grimp reads every import statement, also those inside functions and under ``if``, so an
    import moved into a function to dodge a cycle is still counted.
    """
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as exc:
        # graphlib lists each module before the one that imports it.
        return list(reversed(exc.args[1]))
    return None


def test_product_modules_import_each_other_without_a_cycle():
    assert import_cycle("vigil") is None


def test_a_planted_cycle_is_found(tmp_path, monkeypatch):
    """The check above can fail: two modules that import each other, one of them late."""
    package = tmp_path / "planted_cycle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from planted_cycle import b\n")
    (package / "b.py").write_text("def late():\n    from planted_cycle import a\n")
    (package / "c.py").write_text("from planted_cycle import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cycle = import_cycle("planted_cycle")
    assert cycle in (
        ["planted_cycle.a", "planted_cycle.b", "planted_cycle.a"],
        ["planted_cycle.b", "planted_cycle.a", "planted_cycle.b"],
    )


def test_no_imports_inside_functions_but_the_deliberate_ones():
    found = set()
    for path in PRODUCT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    found |= {(path.relative_to(PRODUCT).as_posix(), alias.name) for alias in node.names}
                elif isinstance(node, ast.ImportFrom):
                    found.add((path.relative_to(PRODUCT).as_posix(), node.module or ""))
    assert found == DELIBERATE_LATE_IMPORTS
