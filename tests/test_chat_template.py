"""service.text.chat_template against Hugging Face transformers' `apply_chat_template` as the reference.

The reference renders through a tiny in-memory transformers tokenizer (chat templates need no
vocabulary), so nothing is loaded or downloaded. Rendering with a model's own template and special
tokens, end to end through `Tokenizer`, is covered in test_tokenizer.py.
"""

from __future__ import annotations

import datetime

import pytest
import tokenizers
from jinja2.exceptions import SecurityError
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from service.text.chat_template import ChatTemplate, ChatTemplateError

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
