"""The ``vigil`` command imports a command's module only when that command runs
(vigil.service.LazyGroup): its tables must name every command of every module, and a
command that needs no model must not pay for the Anthropic SDK's import."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

from vigil import cli
from vigil.ops import runs as run_commands

PRODUCT = Path(cli.__file__).parent


def _modules_with_commands() -> set[str]:
    """Every product module that declares a top-level ``commands`` list."""
    found = set()
    for path in PRODUCT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "commands" for t in node.targets):
                found.add("vigil." + ".".join(path.relative_to(PRODUCT).with_suffix("").parts))
    return found


def test_the_tables_name_every_command_of_every_module_once():
    tables = {**{m: names for m, names in cli.AREAS.items()}}
    for name, module in run_commands.SUBCOMMANDS.items():
        tables.setdefault(module, ())
        tables[module] = (*tables[module], name)
    assert set(tables) == _modules_with_commands()
    for module, names in tables.items():
        declared = [c.name for c in importlib.import_module(module).commands]
        assert sorted(declared) == sorted(names), module
    top = [n for names in cli.AREAS.values() for n in names]
    assert len(top) == len(set(top)) == len(cli.COMMANDS)


def test_a_command_that_needs_no_model_does_not_import_the_anthropic_sdk():
    probe = (
        "import sys\n"
        "from vigil.cli import main\n"
        "for argv in (['runs', 'show', '--help'], ['ingest', '--help'], ['profiles', 'list', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('anthropic' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
    replay = probe.replace("['runs', 'show', '--help']", "['runs', 'replay', '--help']")
    out = subprocess.run([sys.executable, "-c", replay], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True"  # the probe can see the import
