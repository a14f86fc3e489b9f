"""The README documents every VIGIL_ setting: its configuration table is `vigil config`'s."""

from __future__ import annotations

import re
from pathlib import Path

from vigil.config_command import SETTINGS_CLASSES
from vigil.settings import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_configuration_table_is_current():
    text = README.read_text()
    block = re.search(r"<!-- config:start -->\n(.*?)<!-- config:end -->", text, re.S)
    assert block, "README lacks the config markers"
    assert block.group(1).strip() == settings_table(SETTINGS_CLASSES).strip(), (
        "README's configuration table is stale: run `vigil config` and paste it between the markers "
        "(or `python -m vigil.readme` to do it)"
    )


def test_quick_start_is_two_commands():
    text = README.read_text()
    quick = re.search(r"## Quick start\n(.*?)\n## ", text, re.S).group(1)
    commands = re.search(r"```sh\n(.*?)```", quick, re.S).group(1).strip().splitlines()
    assert [c.split("#")[0].strip() for c in commands] == ["make up", "make test"]
