"""The product's layout (docs/architecture.md, "Layout" and "Layers").

Which package may import which is import-linter's (the contracts in pyproject.toml, run by
`make lint`): the layers, the services' independence, the console's limits, the product
never importing its tooling (``vigil_dev``), no cycle between a package's modules. This file
holds what an import statement cannot show, or what import-linter does not check:

- the tooling is not loaded by importing the product, nor named in a string;
- no cycle between the product's modules also through a package's own ``__init__``;
- no import inside a function but the few deliberate ones;
- docs/architecture.md lists the contracts' layers, and every file it cites exists.
"""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]
PRODUCT = REPO / "services" / "vigil"
ARCHITECTURE = REPO / "docs" / "architecture.md"

# The imports inside functions the product keeps on purpose, each for a heavy dependency that
# only some deployments use (the reason is commented at the import).
DELIBERATE_LATE_IMPORTS = {
    ("agent/__init__.py", "vigil.agent.claude"),  # the Anthropic SDK: VIGIL_AGENT=claude only
    ("ops/agent.py", "vigil.agent.actions"),  # the MCP SDK (2 s to import): `vigil tools list` only
    ("agent/actions.py", "vigil.agent.mcp_tools"),  # the MCP SDK: only when VIGIL_MCP_SERVERS names servers
    ("worker/commands.py", "vigil.worker.main"),  # the agent and the Anthropic SDK (2 s): `vigil worker` only
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
    import moved into a function to dodge a cycle is still counted. import-linter's
    ``acyclic`` contract sees cycles between the modules and subpackages of one package, not
    one through a package's own ``__init__`` (a module importing its package, which imports
    the module): this sees every cycle between modules.
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


def test_a_planted_cycle_through_a_package_init_is_found(tmp_path, monkeypatch):
    """The case import-linter's acyclic contract does not see: a package's ``__init__``
    imports its module, which imports the package."""
    package = tmp_path / "planted_init_cycle"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from planted_init_cycle.sub import leaf\n")
    (package / "sub" / "leaf.py").write_text("import planted_init_cycle.sub\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cycle = import_cycle("planted_init_cycle")
    assert cycle is not None and set(cycle) == {"planted_init_cycle.sub", "planted_init_cycle.sub.leaf"}


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


def contract_layers() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (layers,) = [c for c in config["tool"]["importlinter"]["contracts"] if c.get("id") == "layers"]
    return layers["layers"]


def documented_layers() -> list[str]:
    """The numbered list of docs/architecture.md's "Layers" section: the code span opening each item."""
    section = ARCHITECTURE.read_text(encoding="utf-8").split("\n### Layers", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.MULTILINE)


def test_architecture_lists_the_layers_the_contract_checks():
    assert documented_layers() == contract_layers()


# Where docs/architecture.md's file names are read from, first match wins: the repository,
# the product, its tooling, the ledger and its queries.
CITED_FROM = [
    REPO,
    PRODUCT,
    REPO / "services" / "vigil_dev",
    PRODUCT / "ledger",
    PRODUCT / "ledger" / "queries",
]
CITED = re.compile(r"`([\w./*-]+(?:\.(?:py|sql|md|json|avsc|toml|html)|/))`")


def cited_file_exists(cited: str) -> bool:
    pattern = cited.rstrip("/")
    if any(any(base.glob(pattern)) for base in CITED_FROM):
        return True
    return "/" not in pattern and any((REPO / "services").rglob(pattern))


def test_architecture_cites_only_files_that_exist():
    """Every file or folder docs/architecture.md names in a code span (``ledger/claims.py``,
    ``services/vigil/worker/``, ``queries/*.sql``) exists; a bare name (``main.py``) is one
    that some package has."""
    cited = set(CITED.findall(ARCHITECTURE.read_text(encoding="utf-8")))
    assert len(cited) > 50  # the pattern finds the citations, not nothing
    assert sorted(name for name in cited if not cited_file_exists(name)) == []


def test_the_citation_check_can_fail():
    assert CITED.findall("the claim (`ledger/claims.py`, `worker/`) and `vigil_runs_total`") == [
        "ledger/claims.py",
        "worker/",
    ]
    assert cited_file_exists("ledger/claims.py") and cited_file_exists("main.py")
    assert not cited_file_exists("ledger/no_such_module.py")
    assert not cited_file_exists("no_such_module.py")
