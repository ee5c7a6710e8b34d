"""service.text.chat_template against Hugging Face transformers' `apply_chat_template` as the reference.

The reference renders through a tiny in-memory transformers tokenizer (chat templates need no
vocabulary), so nothing is loaded or downloaded. Rendering with a model's own template and special
tokens, end to end through `Tokenizer`, is covered in test_tokenizer.py.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time

import pytest
import tokenizers
from jinja2.exceptions import SecurityError
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from service.text.chat_template import (
    MAX_RENDERED_CHARS,
    MAX_TEMPLATE_BYTES,
    RENDER_CPU_SECONDS,
    ChatTemplate,
    ChatTemplateError,
    TemplateCache,
)
from service.text.template_budget import MAX_BUILT_ITEMS, MAX_VALUE_ITEMS
from service.text.tokenizer import Tokenizer

SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
HI = [{"role": "user", "content": "hi"}]

STRING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}{% endfor %}"
)
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ tools | tojson(indent=2) }}\n{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}{{ flavour | default('plain') }}"
)


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerFast:
    """A transformers tokenizer with the same special-token strings, used only to render templates."""
    backend = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **SPECIAL_TOKENS)


def reference(hf: PreTrainedTokenizerFast, template: str, messages: list[dict], **extra) -> str:
    return hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, **extra
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_string_template_matches_transformers(hf, add_generation_prompt):
    messages = [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Q 🐔"},
        {"role": "assistant", "content": "A\nmulti-line\n"},
    ]
    ours = ChatTemplate(STRING_TEMPLATE).render(messages, add_generation_prompt, SPECIAL_TOKENS)
    ref = hf.apply_chat_template(
        messages, chat_template=STRING_TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref


def test_text_parts_are_joined_for_string_templates(hf):
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "you"}]}
    ]
    joined = [{"role": "user", "content": "Hello you"}]
    assert ChatTemplate(STRING_TEMPLATE).render(parts) == reference(hf, STRING_TEMPLATE, joined)


def test_templates_that_loop_over_parts_get_the_list(hf):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "plain"},
    ]
    template = ChatTemplate(PARTS_TEMPLATE)
    assert template.render(messages) == "<user>[a][b]<assistant>plain"
    assert template.render(messages) == reference(hf, PARTS_TEMPLATE, messages)


def test_extra_variables_and_tojson_match_transformers(hf):
    tools = [{"type": "function", "function": {"name": "météo", "description": '<b> & "quotes"', "x": None}}]
    messages = [{"role": "user", "content": "weather?", "name": None}]
    ours = ChatTemplate(TOOLS_TEMPLATE).render(messages, True, SPECIAL_TOKENS, tools=tools, flavour="spicy")
    assert ours == reference(hf, TOOLS_TEMPLATE, messages, tools=tools, flavour="spicy")
    assert '"météo"' in ours and '<b> & \\"quotes\\"' in ours


def test_extra_variables_override_special_tokens():
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ documents }}")
    assert template.render(HI, True, SPECIAL_TOKENS) == "<|im_start|>|<|im_end|>|None|None"
    assert template.render(HI, True, SPECIAL_TOKENS, eos_token="</s>") == "<|im_start|>|</s>|None|None"
    assert template.source.startswith("{{ bos_token }}") and template.error is None


def test_non_text_parts_are_rejected():
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content\[0\].*'image_url'"):
        ChatTemplate(STRING_TEMPLATE).render(image)


def test_raise_exception_becomes_chat_template_error():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('first message must be system') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError) as info:
        template.render(HI)
    assert str(info.value) == "first message must be system"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{% set x = [] %}{{ x.append(1) }}",
        "{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
    ],
)
def test_sandbox_escapes_are_refused(template):
    with pytest.raises(ChatTemplateError, match="unsafe") as info:
        ChatTemplate(template).render(HI)
    assert isinstance(info.value.__cause__, SecurityError)


def test_template_errors_are_one_line():
    invalid = ChatTemplate("{% for x in %}")
    assert invalid.error is not None and invalid.error.startswith("chat template is invalid")
    for source, message in [
        ("{% for x in %}", "chat template is invalid"),
        ("{{ messages[0].content + 1 }}", "chat template failed to render"),
    ]:
        with pytest.raises(ChatTemplateError, match=message) as info:
            ChatTemplate(source).render(HI)
        assert "\n" not in str(info.value)
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        ChatTemplate(STRING_TEMPLATE).render([])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be an object"):
        ChatTemplate(STRING_TEMPLATE).render([*HI, "oops"])


def test_strftime_now():
    assert ChatTemplate("{{ strftime_now('%Y') }}").render(HI) == str(datetime.date.today().year)


GEMMA3_CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Name a colour. \n"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ],
    [
        {"role": "system", "content": [{"type": "text", "text": "Sys as parts"}]},
        {"role": "user", "content": [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]},
    ],
]


@pytest.mark.parametrize("messages", GEMMA3_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma3_template_matches_transformers(hf, messages, add_generation_prompt):
    """google/gemma-3-1b-it's template: the system message folded into the first user turn,
    assistant turns as "model", text parts trimmed and joined."""
    from tests.test_model_gemma3 import GEMMA3_TEMPLATE

    ours = ChatTemplate(GEMMA3_TEMPLATE).render(messages, add_generation_prompt, SPECIAL_TOKENS)
    ref = hf.apply_chat_template(
        messages, chat_template=GEMMA3_TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == ref
    assert ours.startswith("<|im_start|><start_of_turn>user\n")


def test_gemma3_template_refuses_roles_that_do_not_alternate(hf):
    from tests.test_model_gemma3 import GEMMA3_TEMPLATE

    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        reference(hf, GEMMA3_TEMPLATE, messages)
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(GEMMA3_TEMPLATE).render(messages)
    assert str(info.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


# ---------------------------------------------------------------------------------------------
# Limits: every render (a model's template too) is stopped past its CPU seconds and output size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        # no call, attribute or output in the inner loop: only the watchdog can stop it
        "{% set l = range(100000) | list %}{% for a in l %}{% for b in l %}{% endfor %}{% endfor %}",
    ],
    ids=["nested-ranges", "plain-loops"],
)
def test_a_template_looping_without_output_stops_at_the_deadline(template: str) -> None:
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=f"over {RENDER_CPU_SECONDS:g} s of CPU time") as info:
        ChatTemplate(template).render(HI)
    assert "\n" not in str(info.value)
    assert time.monotonic() - started < 60  # CPU seconds; the wall clock runs on under load
    # The thread goes on unharmed: no stopping exception is left pending for it.
    assert (
        ChatTemplate(STRING_TEMPLATE).render(HI, True)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    time.sleep(0.2)


def test_the_limit_stops_only_its_own_render_on_a_worker_thread() -> None:
    endless = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    quick = ChatTemplate(STRING_TEMPLATE)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stopped = pool.submit(endless.render, HI)
        rendered = [pool.submit(quick.render, HI).result() for _ in range(200)]
        with pytest.raises(ChatTemplateError, match="CPU time"):
            stopped.result()
        assert pool.submit(quick.render, HI).result() == rendered[0]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "rendered over"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}", "over"),
        ("{{ 'x' * 10000000000 }}", "would build a value of over"),
        ("{{ ([1] * 100000) * 100000 }}", "would build a value of over"),
        ("{{ 7 ** 1000000000 }}", "power of over"),
    ],
    ids=["big-chunks", "many-chunks", "repeat-string", "repeat-list", "power"],
)
def test_output_bombs_stop(template: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message) as info:
        ChatTemplate(template).render(HI)
    assert "\n" not in str(info.value)
    assert (
        f"{MAX_RENDERED_CHARS}" in str(info.value)
        or f"{MAX_VALUE_ITEMS}" in str(info.value)
        or f"over {MAX_BUILT_ITEMS} items in all" in str(info.value)  # a fast host builds that before
        or "CPU time" in str(info.value)  # a slow one spends it first
        or "bits" in str(info.value)
    )


def test_small_repetitions_and_powers_still_work() -> None:
    assert (
        ChatTemplate("{{ '-' * 3 }}{{ 3 * 'ab' }}{{ 2 ** 10 }}{{ 2.5 * 2 }}").render(HI) == "---ababab10245.0"
    )


def test_a_template_nested_past_the_compiler_is_an_error_not_a_crash() -> None:
    deep = ChatTemplate("{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}")
    assert deep.error is not None and "\n" not in deep.error
    with pytest.raises(ChatTemplateError, match="chat template is invalid"):
        deep.render(HI)


def test_request_templates_are_size_limited_compiled_once_and_the_cache_is_bounded() -> None:
    cache = TemplateCache(max_entries=3, max_bytes=10_000)
    first = cache.get("{{ 1 }}")
    assert cache.get("{{ 1 }}") is first  # compiled once
    for i in range(5):
        cache.get(f"{{{{ {i} }}}}")
    assert len(cache) == 3  # bounded by count, least recently used out
    by_bytes = TemplateCache(max_entries=100, max_bytes=12_000)
    for i in range(5):
        by_bytes.get("{# " + "x" * 3000 + f" #}}{i}")
    # bounded by what they hold: three 3 kB sources fit, with the code Jinja wrote for each (< 1 kB)
    assert len(by_bytes) == 3 and by_bytes.nbytes <= 12_000
    by_bytes.get("{# " + "y" * 6000 + " #}")
    assert len(by_bytes) == 2 and by_bytes.nbytes <= 12_000
    over = "x" * (MAX_TEMPLATE_BYTES + 1)
    with pytest.raises(ChatTemplateError) as info:
        cache.get(over)
    assert (
        str(info.value)
        == f"chat_template is {MAX_TEMPLATE_BYTES + 1} bytes, over the {MAX_TEMPLATE_BYTES} limit"
    )
    with pytest.raises(ChatTemplateError, match="chat template is invalid"):
        cache.get("{% for x in %}")


def test_a_request_template_is_rendered_instead_of_the_models() -> None:
    backend = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tokenizer = Tokenizer(backend=backend, vocab_size=1, templates={"default": STRING_TEMPLATE})
    own = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ flavour }}"
    assert tokenizer.apply_chat_template(HI, chat_template=own, flavour="!") == "[user|hi]!"
    assert tokenizer.chat_template_for(source=own) is tokenizer.chat_template_for(source=own)
    assert tokenizer.apply_chat_template(HI).startswith("<|im_start|>user")  # the model's, unchanged
    with pytest.raises(ChatTemplateError, match="chat template is invalid"):
        tokenizer.apply_chat_template(HI, chat_template="{% if %}")
