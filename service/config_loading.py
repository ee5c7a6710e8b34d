"""Reading the configuration: the environment and command-line flags into one `Settings`, validated
once, every problem refused in one line (`ConfigError`).

The environment's NIM_* variables are checked against what this server reads or NIM documents
(service.nim_variables) before anything is read; NIM_PASSTHROUGH_ARGS adds its flags below the
command line's; two names of one setting, or a flag and its variable, given different values are
refused, since one would be ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import AliasChoices, SecretStr, TypeAdapter, ValidationError

from service.config import Settings
from service.nim_variables import check_environment
from service.serve_flags import FlagError, passthrough_flags
from service.store.model_uri import ModelRefError, parse_model_ref


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable and what is allowed."""


def read_variables() -> dict[str, str]:
    """Every environment variable Settings reads -> its setting's own variable (the first name)."""
    read: dict[str, str] = {}
    for info in Settings.model_fields.values():
        alias = info.validation_alias
        assert isinstance(alias, AliasChoices)
        names = [str(choice) for choice in alias.choices]
        read.update(dict.fromkeys(names, names[0]))
    return read


def load_settings(
    *, sources: Mapping[str, str] | None = None, needs_lora: str | None = None, **overrides: Any
) -> Settings:
    """Read the environment, apply non-None overrides (command-line flags), validate once.

    Overrides are raw flag values of any type: pydantic validates and converts them, as it does the
    environment's strings; `sources` says how each was given ("--max-model-len 8k"), for messages.
    `needs_lora`: a flag (--enable-lora) that asks for adapters, so some must be named.
    Before anything is read, every NIM_* variable must be one this server reads or NIM documents
    and it honours (service.nim_variables); NIM_PASSTHROUGH_ARGS adds its flags below the command
    line's. A flag and a variable of the same setting (or two names of one setting, or the command
    line and NIM_PASSTHROUGH_ARGS) given with different values are refused: one would be ignored.
    """
    env = dict(os.environ)
    check = check_environment(env, read_variables())
    problems = [*check.problems, *_alias_conflicts(env)]
    if problems:
        raise ConfigError("; ".join(problems))
    flags = {k: v for k, v in overrides.items() if v is not None}
    origin = {name: (sources or {}).get(name, f"--{name.replace('_', '-')}") for name in flags}
    try:
        passthrough = passthrough_flags(_env_value(env, "NIM_PASSTHROUGH_ARGS"))
    except FlagError as exc:
        raise ConfigError(str(exc)) from None
    for name, value in passthrough.values.items():
        given = f"NIM_PASSTHROUGH_ARGS {passthrough.sources[name]}"
        if name in flags and not _same(name, flags[name], value):
            raise ConfigError(f"{origin[name]} and {given} disagree: give it once")
        flags.setdefault(name, value)
        origin.setdefault(name, given)
    try:
        settings = Settings(**flags)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    conflicts = _flag_conflicts(flags, origin, env)
    asked = needs_lora or (passthrough.needs_lora and f"NIM_PASSTHROUGH_ARGS {passthrough.needs_lora}")
    if asked and settings.lora is None:
        conflicts.append(f"{asked}: name the adapters to serve (NIM_PEFT_SOURCE or --lora-modules)")
    if conflicts:
        raise ConfigError("; ".join(conflicts))
    settings._service_links = tuple(check.service_links)
    return settings


def _env_value(env: Mapping[str, str], name: str) -> str | None:
    """`name`'s value as pydantic-settings reads it (names compare case-insensitively)."""
    return next((value for key, value in env.items() if key.upper() == name), None)


def _alias_conflicts(env: Mapping[str, str]) -> list[str]:
    """Two names of one setting (NIM_ENFORCE_EAGER and NIM_DISABLE_CUDA_GRAPH) set differently."""
    problems = []
    for name, info in Settings.model_fields.items():
        alias = info.validation_alias
        assert isinstance(alias, AliasChoices)
        given = [(str(c), v) for c in alias.choices if (v := _env_value(env, str(c))) is not None]
        for other, value in given[1:]:
            if not _same(name, given[0][1], value):
                problems.append(f"{_shown(name, given[0][0], given[0][1])} and {_shown(name, other, value)} "
                                "disagree: they are one setting, set one of them")  # fmt: skip
    return problems


def _flag_conflicts(flags: Mapping[str, Any], origin: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """A flag whose setting's variable is also set, to another value."""
    problems = []
    for name, value in flags.items():
        alias = Settings.model_fields[name].validation_alias
        assert isinstance(alias, AliasChoices)
        for choice in map(str, alias.choices):
            raw = _env_value(env, choice)
            if raw is not None and not _same(name, value, raw):
                problems.append(f"{origin[name]} and {_shown(name, choice, raw)} disagree: give one of them")
    return problems


def _shown(field: str, variable: str, value: str) -> str:
    secret = Settings.model_fields[field].annotation in (SecretStr, SecretStr | None)
    return f"{variable}=<hidden>" if secret else f"{variable}={value!r}"


def _same(field: str, a: Any, b: Any) -> bool:
    """Whether two raw values of one setting mean the same (as pydantic converts them)."""
    if field in ("model_name", "model_path"):
        try:
            left_ref, right_ref = parse_model_ref(field, str(a)), parse_model_ref(field, str(b))
        except ModelRefError:
            return str(a).strip() == str(b).strip()
        return left_ref.same_model(right_ref) and left_ref.revision == right_ref.revision
    adapter: TypeAdapter[Any] = TypeAdapter(Settings.model_fields[field].annotation)
    try:
        left, right = adapter.validate_python(_stripped(a)), adapter.validate_python(_stripped(b))
    except ValidationError:
        return str(a).strip().lower() == str(b).strip().lower()
    if isinstance(left, SecretStr) and isinstance(right, SecretStr):
        return left.get_secret_value() == right.get_secret_value()
    return bool(left == right)


def _stripped(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        message = str(err["msg"]).removeprefix("Value error, ")
        if not err["loc"]:  # a cross-field check: its message names the variables (never echo input)
            lines.append(message)
            continue
        field = str(err["loc"][0])
        info = Settings.model_fields.get(field)
        alias = info.validation_alias if info else None
        name = alias.choices[0] if isinstance(alias, AliasChoices) else field
        shown = (
            "<hidden>"
            if info is not None and info.annotation in (SecretStr, SecretStr | None)
            else repr(err.get("input"))
        )
        lines.append(f"invalid {name}={shown}: {message}")
    return "; ".join(lines)
