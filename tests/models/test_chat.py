"""models.chat: a GGUF's Jinja chat template rendered as transformers and llama-server render it."""

from __future__ import annotations

import pytest

from specdec.errors import SpecdecError
from specdec.models.chat import render

# a ChatML template that opens with a default system message when the request has none (as
# Qwen2.5's does), with the constructs real templates use: loop controls, raise_exception, tojson
TEMPLATE = (
    "{%- if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}\n"
    "{%- for m in messages %}\n"
    "  {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}"
    "{% endif %}\n"
    "  {%- if m.content == 'skip' %}{% continue %}{% endif %}\n"
    "  {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_the_template_adds_its_default_system_message_and_opens_the_answer():
    user = [{"role": "user", "content": "hi"}]
    assert render(TEMPLATE, user) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    given = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "skip"}, *user]
    assert render(TEMPLATE, given) == (  # no default where one is given; a skipped turn (loop controls)
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_bos_and_eos_tokens_and_tojson_reach_the_template():
    template = "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}{{ eos_token }}"
    assert render(template, [{"role": "user", "content": "café"}], "<s>", "</s>") == (
        '<s>{"role": "user", "content": "café"}</s>'
    )


def test_a_template_that_refuses_or_does_not_parse_is_one_clear_error():
    with pytest.raises(SpecdecError, match="refused these messages: unknown role tool"):
        render(TEMPLATE, [{"role": "tool", "content": "x"}])
    with pytest.raises(SpecdecError, match="does not parse"):
        render("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(SpecdecError, match="refused"):  # the sandbox: no reaching into Python
        render("{{ messages.__class__.__mro__ }}", [])


def test_without_jinja2_a_chat_prompt_is_one_clear_error(monkeypatch):
    from specdec.models import chat

    chat._compile.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "jinja2", None)  # import jinja2 -> ImportError
    with pytest.raises(SpecdecError, match="needs jinja2"):
        render(TEMPLATE, [{"role": "user", "content": "hi"}])
    chat._compile.cache_clear()
