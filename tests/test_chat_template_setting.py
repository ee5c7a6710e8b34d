"""NIM_CHAT_TEMPLATE: a file or inline Jinja that replaces the model's chat templates.

The rule: an existing file is read; otherwise a value holding `{{` or `{%` is the template itself;
anything else, an empty file or a template that does not compile stops start-up with one line.
The real server, started with a file template and with an inline one, renders conversations with
it (seen through /tokenize then /detokenize), tools included: the model's tool_use template is
replaced too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.config_loading import ConfigError, load_settings
from tests.conftest import EMBEDDED_NAME, ServerProcess, free_port
from tests.test_cli import run_cli
from tests.test_quantization import serving

FILE_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
INLINE_TEMPLATE = "{% for m in messages %}<{{ m.role | upper }}:{{ m.content }}>{% endfor %}"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_a_file_is_read_and_inline_jinja_is_the_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(FILE_TEMPLATE)
    assert load_settings(chat_template=str(path)).chat_template_source == FILE_TEMPLATE
    assert load_settings(chat_template=INLINE_TEMPLATE).chat_template_source == INLINE_TEMPLATE
    assert load_settings().chat_template_source is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "templates/chatml.jinja",
            "NIM_CHAT_TEMPLATE: 'templates/chatml.jinja' is neither a file nor a Jinja template",
        ),
        ("{% for m in %}", "NIM_CHAT_TEMPLATE: the inline template: chat template is invalid: "),
        ("{{ (" * 5000, "nested too deeply"),
    ],
    ids=["neither", "invalid-inline", "too-deep"],
)
def test_a_bad_value_is_one_line(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(chat_template=value)
    assert str(info.value).startswith(message) or message in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_a_bad_file_is_one_line(tmp_path: Path) -> None:
    empty, broken = tmp_path / "empty.jinja", tmp_path / "broken.jinja"
    empty.write_text(" \n")
    broken.write_text("line one\n{% if %}")
    with pytest.raises(ConfigError, match=f"NIM_CHAT_TEMPLATE: {empty} is empty"):
        load_settings(chat_template=str(empty))
    with pytest.raises(
        ConfigError, match=rf"NIM_CHAT_TEMPLATE: {broken}: chat template is invalid: .*\(line 2\)"
    ):
        load_settings(chat_template=str(broken))


def test_start_up_stops_with_one_line() -> None:
    done = run_cli("serve", "--port", str(free_port()), env={"NIM_CHAT_TEMPLATE": "chatml"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "configuration error: NIM_CHAT_TEMPLATE: 'chatml' is neither a file nor a Jinja template"
    ]


def _rendered(server: ServerProcess, messages: list[dict]) -> str:
    body = {"model": EMBEDDED_NAME, "messages": messages, "add_generation_prompt": True}
    tokens = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60)
    assert tokens.status_code == 200, tokens.text
    text = httpx.post(
        f"{server.base_url}/detokenize",
        json={"model": EMBEDDED_NAME, "tokens": tokens.json()["tokens"]},
        timeout=60,
    )
    return text.json()["prompt"]


@pytest.fixture(scope="module", params=["file", "inline"])
def configured(request, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerProcess]]:
    directory = tmp_path_factory.mktemp("chat-template")
    if request.param == "file":
        path = directory / "template.jinja"
        path.write_text(FILE_TEMPLATE)
        value, expected = str(path), "[system] Be brief.\n[user] Hi there\n[assistant]"
    else:
        value, expected = INLINE_TEMPLATE, "<SYSTEM:Be brief.><USER:Hi there>"
    with serving(directory / "server.log", {"NIM_CHAT_TEMPLATE": value}) as server:
        yield expected, server


def test_the_server_renders_with_the_configured_template(configured: tuple[str, ServerProcess]) -> None:
    expected, server = configured
    assert _rendered(server, CONVERSATION) == expected
    body = {
        "model": EMBEDDED_NAME,
        "messages": CONVERSATION,
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    # the configured template reads no tools, and it replaced the embedded model's tool_use template
    assert response.status_code == 400 and "does not render tools" in response.text, response.text
    plain = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "tools": None}, timeout=120)
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["prompt_tokens"] == len(
        httpx.post(
            f"{server.base_url}/tokenize",
            json={"model": EMBEDDED_NAME, "messages": CONVERSATION, "add_generation_prompt": True},
            timeout=60,
        ).json()["tokens"]
    )
