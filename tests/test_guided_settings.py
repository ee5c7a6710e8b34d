"""The NIM_*GUIDED* limits: read, defaulted and validated like every setting, and handed to the
engine's configuration as one value."""

from __future__ import annotations

import pytest

from service.config_loading import ConfigError, load_settings
from service.engine.config import GuidedLimits

GUIDED = (
    "NIM_MAX_GUIDED_SPEC_BYTES",
    "NIM_GUIDED_COMPILE_TIMEOUT_SECONDS",
    "NIM_GUIDED_COMPILE_WORKERS",
    "NIM_GUIDED_CACHE_BYTES",
)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in GUIDED:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_the_engines_own() -> None:
    assert load_settings().guided_limits == GuidedLimits()
    assert GuidedLimits() == GuidedLimits(65536, 10.0, 2, 256 * 1024 * 1024)


def test_the_environment_sets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in zip(GUIDED, ("1024", "2.5", "4", "0"), strict=True):
        monkeypatch.setenv(name, value)
    assert load_settings().guided_limits == GuidedLimits(1024, 2.5, 4, 0)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NIM_MAX_GUIDED_SPEC_BYTES", "12"),
        ("NIM_MAX_GUIDED_SPEC_BYTES", "big"),
        ("NIM_GUIDED_COMPILE_TIMEOUT_SECONDS", "0"),
        ("NIM_GUIDED_COMPILE_TIMEOUT_SECONDS", "-1"),
        ("NIM_GUIDED_COMPILE_WORKERS", "0"),
        ("NIM_GUIDED_COMPILE_WORKERS", "1000"),
        ("NIM_GUIDED_CACHE_BYTES", "-1"),
    ],
)
def test_invalid_values_stop_start_up_in_one_line(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert message.startswith(f"invalid {var}=") and "\n" not in message, message
