"""Parsers of setting values that are more than one scalar: comma-separated lists, NIM_LORA_MODULES'
name=path pairs, NIM_CHAT_TEMPLATE's file or inline template; and the log levels NIM_LOG_LEVEL names.

Each raises ValueError with a one-line message naming the variable (Settings' validators turn it into
a ConfigError)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from service.text.chat_template import ChatTemplate

LogLevel = Literal["DEFAULT", "TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def split_list(value: str | None) -> list[str]:
    """A comma-separated setting's entries, stripped, blanks dropped."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def lora_modules(value: str | None) -> tuple[tuple[str, Path], ...]:
    """NIM_LORA_MODULES as (name, path) pairs: `name=path`, comma-separated. ValueError, one line,
    for an entry that is not name=path (the adapters themselves are checked when they are read)."""
    modules = []
    for entry in split_list(value):
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"NIM_LORA_MODULES entry {entry!r} is not name=path")
        modules.append((name.strip(), Path(path.strip()).expanduser()))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"NIM_LORA_MODULES names an adapter twice: {', '.join(sorted(names))}")
    return tuple(modules)


def chat_template_source(value: str) -> str:
    """NIM_CHAT_TEMPLATE's template: an existing file's text, else the value itself when it is Jinja
    (holds `{{` or `{%`); checked to compile. ValueError, one line, otherwise."""
    shown = repr(value) if len(value) <= 80 else repr(value[:77]) + "..."
    try:
        path = Path(value).expanduser()
        is_file = path.is_file()
    except (OSError, ValueError):  # a long inline template is no file name
        is_file = False
    if is_file:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"NIM_CHAT_TEMPLATE: cannot read {path} ({' '.join(str(exc).split())})"
            ) from None
        if not source.strip():
            raise ValueError(f"NIM_CHAT_TEMPLATE: {path} is empty")
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"NIM_CHAT_TEMPLATE: {shown} is neither a file nor a Jinja template")
    error = ChatTemplate(source).error
    if error is not None:
        where = str(path) if is_file else "the inline template"
        raise ValueError(f"NIM_CHAT_TEMPLATE: {where}: {error}")
    return source
