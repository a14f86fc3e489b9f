"""One exception base: every exception class a product module defines derives from `VigilError`.

The classes are found in the source (ast: every `class` statement, nested ones too), then
resolved by importing their module, so a base from a library (`httpcore.ConnectError`,
`ValueError`) is seen for what it is. A class that must also be a library's exception keeps
that base beside `VigilError`."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from vigil.errors import VigilError

SERVICES = Path(__file__).resolve().parents[1] / "services"
PRODUCT = SERVICES / "vigil"


def class_paths(tree: ast.Module) -> list[list[str]]:
    """The dotted paths of the module-level classes and the classes nested in them."""
    found = []

    def visit(node: ast.AST, outer: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found.append([*outer, child.name])
                visit(child, [*outer, child.name])

    visit(tree, [])
    return found


def exception_classes() -> dict[str, type]:
    classes = {}
    for path in sorted(PRODUCT.rglob("*.py")):
        if path.name == "__main__.py":
            continue  # running the CLI is what importing it does
        parts = path.relative_to(SERVICES).with_suffix("").parts
        module_name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        paths = class_paths(ast.parse(path.read_text()))
        if not paths:
            continue
        module = importlib.import_module(module_name)
        for dotted in paths:
            obj = module
            for name in dotted:
                obj = getattr(obj, name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                classes[f"{module_name}.{'.'.join(dotted)}"] = obj
    return classes


def test_every_exception_class_derives_from_vigil_error():
    classes = exception_classes()
    assert "vigil.settings.SettingsError" in classes, "the scan found too little"
    assert sorted(name for name, cls in classes.items() if not issubclass(cls, VigilError)) == []


def test_the_scan_sees_a_class_that_escapes(tmp_path, monkeypatch):
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("class Outer:\n    class Escaped(KeyError):\n        pass\n")
    monkeypatch.setattr(f"{__name__}.SERVICES", tmp_path)
    monkeypatch.setattr(f"{__name__}.PRODUCT", package)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert list(exception_classes()) == ["planted.mod.Outer.Escaped"]
