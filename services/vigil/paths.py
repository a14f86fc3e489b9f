"""Where vigil's data files are: the Avro schemas and the ledger's SQL."""

from __future__ import annotations

from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


@cache
def schemas_dir() -> Path:
    """``schemas/`` of the repo (editable install) or its copy inside the wheel."""
    for candidate in (PACKAGE_DIR / "_schemas", PACKAGE_DIR.parent.parent / "schemas"):
        if (candidate / "ledger" / "schema.sql").is_file():
            return candidate
    raise FileNotFoundError("vigil's schemas/ folder is missing from this installation")


def repo_root() -> Path:
    """The checkout this package runs from (the dev stack and tests only)."""
    return PACKAGE_DIR.parent.parent
