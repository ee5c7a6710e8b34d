"""README stays true: its configuration table lists exactly the settings that exist, and its
renderings of the NIM variable table and the vLLM flag table equal the code's."""

from __future__ import annotations

import re
from pathlib import Path

from service import nim_variables, serve_flags
from service.config import Settings
from service.config_loading import read_variables

README = Path(__file__).resolve().parent.parent / "README.md"


def test_configuration_table_matches_settings() -> None:
    text = README.read_text()
    table = text[text.index("## Configuration") :]
    table = table[: min(i for i in (table.find("\n## ", 1), table.find("\n### ", 1)) if i > 0)]
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", table, flags=re.MULTILINE))
    actual = {field.validation_alias.choices[0] for field in Settings.model_fields.values()}
    assert documented == actual


def test_quickstart_has_the_two_commands() -> None:
    text = README.read_text()
    quickstart = text[text.index("## Quickstart") :]
    assert "make serve" in quickstart and "make test" in quickstart
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def _rendered(marker: str) -> str:
    text = README.read_text()
    start, end = f"<!-- {marker}:start -->\n", f"\n<!-- {marker}:end -->"
    return text[text.index(start) + len(start) : text.index(end)]


def test_nim_variable_table_matches_the_code() -> None:
    assert _rendered("nim-variables") == nim_variables.markdown_table(read_variables())


def test_serve_flag_table_matches_the_code() -> None:
    assert _rendered("serve-flags") == serve_flags.markdown_table()
