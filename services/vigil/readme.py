"""``python -m vigil.readme``: refresh the settings table of docs/settings.md from the settings classes."""

from __future__ import annotations

import re

from vigil.ops.config import SETTINGS_CLASSES
from vigil.paths import repo_root
from vigil.settings import settings_table


def main() -> None:
    path = repo_root() / "docs" / "settings.md"
    text = path.read_text()
    table = settings_table(SETTINGS_CLASSES)
    text = re.sub(
        r"(<!-- config:start -->\n).*?(<!-- config:end -->)",
        lambda m: m.group(1) + table + "\n" + m.group(2),
        text,
        flags=re.S,
    )
    path.write_text(text)


if __name__ == "__main__":
    main()
