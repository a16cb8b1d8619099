"""A model's own chat template (the Jinja text a GGUF keeps as `tokenizer.chat_template`), rendered
as Hugging Face transformers renders it and as llama-server does by default (`--jinja`): the
same request then makes the same prompt on every backend and in every server. llama.cpp's C API
(`llama_chat_apply_template`) instead matches the template to one of its built-in formats and
writes that, which drops what the template adds of its own: Qwen2.5's default system message
("You are Qwen, created by Alibaba Cloud. ..."), 21 tokens that llama-server's prompts had and
ours did not, so the two servers answered different conversations.

The environment is the one those renderers use: sandboxed and immutable, blocks trimmed, loop
controls, `raise_exception` and `strftime_now` as globals and a `tojson` that keeps non-ASCII
text, with `messages`, `add_generation_prompt` (always true here: the prompt ends with the
assistant's turn opened), `bos_token` and `eos_token`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from ..errors import SpecdecError

# The roles a chat message may have, as OpenAI's API names them, to the role a chat template knows
# (OpenAI's "developer" is the system message of models that have no such role). The server's
# requests and `specdec train --requests` read messages through this one map.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def render(
    template: str, messages: list[dict], bos_token: str = "", eos_token: str = "", tools: list | None = None
) -> str:
    """The prompt `template` makes of `messages` (and `tools`, for a template that takes them),
    ending with the assistant's turn opened."""
    compiled = _compile(template)  # first: it says in one line where jinja2 is missing
    import jinja2

    try:
        return compiled.render(
            messages=messages, tools=tools, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token
        )
    except jinja2.TemplateError as exc:
        raise SpecdecError(f"the model's chat template refused these messages: {exc}") from None


@lru_cache(maxsize=8)
def _compile(template: str):
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise SpecdecError("the model's chat template needs jinja2: pip install jinja2 (or use --no-chat)") from None

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None, ensure_ascii=False: json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise SpecdecError(f"the model's chat template does not parse: {exc}; use --no-chat") from None
