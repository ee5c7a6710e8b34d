"""The docs stay true: the configuration table in docs/configuration.md lists exactly the settings
that exist, its renderings of the NIM variable table and the vLLM flag table equal the code's, and
the README keeps the Quickstart's two commands, a table of contents and its size."""

from __future__ import annotations

import re
from pathlib import Path

from service import nim_variables, serve_flags
from service.config import Settings
from service.config_loading import read_variables

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CONFIGURATION = REPO / "docs" / "configuration.md"


def _section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    body = text[text.index(heading + "\n") + len(heading) :]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", body, flags=re.MULTILINE)]
    return body[: ends[0]] if ends else body


def test_configuration_table_matches_settings() -> None:
    table = _section(CONFIGURATION.read_text(), "## Settings")
    documented = re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", table, flags=re.MULTILINE)
    actual = {field.validation_alias.choices[0] for field in Settings.model_fields.values()}
    assert len(documented) == len(set(documented)), "a setting is listed twice"
    assert set(documented) == actual


def test_quickstart_has_the_two_commands() -> None:
    quickstart = _section(README.read_text(), "## Quickstart")
    assert "make serve" in quickstart and "make test" in quickstart
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def test_the_readme_is_a_front_door() -> None:
    """Short, with a table of contents whose links reach its sections and the docs they name."""
    text = README.read_text()
    assert len(text.splitlines()) <= 325  # issue 44: about 300; the rest lives in docs/
    contents = _section(text, "## Contents")
    anchors = re.findall(r"\]\(#([a-z0-9-]+)\)", contents)
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^###? (.+)$", text, flags=re.MULTILINE)
    }
    assert anchors and set(anchors) <= headings, set(anchors) - headings
    for link in re.findall(r"\]\(((?:docs|bench|helm|profiles)/[^)#]+)", text):
        assert (REPO / link).exists(), link


def test_every_relative_link_in_the_docs_resolves() -> None:
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name}: {link}"


def _rendered(marker: str) -> str:
    text = CONFIGURATION.read_text()
    start, end = f"<!-- {marker}:start -->\n", f"\n<!-- {marker}:end -->"
    return text[text.index(start) + len(start) : text.index(end)]


def test_nim_variable_table_matches_the_code() -> None:
    assert _rendered("nim-variables") == nim_variables.markdown_table(read_variables())


def test_serve_flag_table_matches_the_code() -> None:
    assert _rendered("serve-flags") == serve_flags.markdown_table()
