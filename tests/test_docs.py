"""README stays true: its configuration table lists exactly the settings that exist."""

from __future__ import annotations

import re
from pathlib import Path

from service.config import Settings

README = Path(__file__).resolve().parent.parent / "README.md"


def test_configuration_table_matches_settings() -> None:
    text = README.read_text()
    table = text[text.index("## Configuration") :]
    table = table[: table.index("\n## ", 1)]
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", table, flags=re.MULTILINE))
    actual = {field.validation_alias.choices[0] for field in Settings.model_fields.values()}
    assert documented == actual


def test_quickstart_has_the_two_commands() -> None:
    text = README.read_text()
    quickstart = text[text.index("## Quickstart") :]
    assert "make serve" in quickstart and "make test" in quickstart
    assert "make test" in (README.parent / ".ci" / "run").read_text()
