"""One request, prepared once: a prompt (text, chat turns or token ids) and a GenerationConfig ->
the prompt's token ids and the final config; and one table of how a request ends.

Every caller prepares through here: the Python API and the CLI (SpeculativeDecoder.generate /
stream / generate_batch), the server's worker and bench (which gives peers the same text as text).

    text        what the model reads: the chat template applied (turns, or one user turn made of
                the text, with the system message if any), or the raw text
    tokens      text -> token ids, or token ids checked against the vocabulary; a text whose bytes
                cannot fit the context is refused before the tokenizer sees it
    prepare     tokens + the config whose token budget is settled against the context (Limit)

The empty-prompt rule is one rule: an empty text is refused; a text of whitespace only is refused
where the chat template would wrap it as the user's turn (the model would see a turn with no
word), and kept as raw text.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import replace
from typing import Literal, Sequence

from .config import GenerationConfig
from .errors import ContextOverflowError, PromptError

# How a request's token budget meets the context window, once its prompt's length is known:
#   "end"     max_new_tokens as given; a row that reaches the context ends there ("context")
#   "fit"     max_new_tokens, or as many as fit where the context leaves fewer (the server's
#             default when a request gives no max_tokens)
#   "refuse"  max_new_tokens as given, and a request that cannot fit them is refused (the server:
#             OpenAI's 400 context_length_exceeded)
Limit = Literal["end", "fit", "refuse"]

# Why a request ended (GenerationStats.finish_reason) -> (OpenAI's finish_reason, the metrics'
# finished_reason label as vLLM's). An end-of-generation token or a stop string is "stop"; the token
# budget or the context is "length"; the server's time limit and a cancel are its own reasons in a
# response, "abort" in the metrics.
FINISH_REASONS = {
    "eog": ("stop", "stop"),
    "stop": ("stop", "stop"),
    "tool_calls": ("tool_calls", "stop"),  # a chat answer read back as tool calls (server/protocol.py)
    "length": ("length", "length"),
    "context": ("length", "length"),
    "time_limit": ("time_limit", "abort"),
    "cancelled": ("cancelled", "abort"),
}


def finish_reason(reason: str) -> str:
    """Our finish reason as a response reports it (OpenAI's word where it has one)."""
    return FINISH_REASONS.get(reason, (reason, "abort"))[0]


def finish_label(reason: str) -> str:
    """Our finish reason as the metrics count it: stop, length or abort."""
    return FINISH_REASONS.get(reason, (reason, "abort"))[1]


def check_text(text: str, chat: bool) -> None:
    """The empty-prompt rule (above), before anything is loaded: `chat` is whether the template
    will wrap the text."""
    if not text:
        raise PromptError("the prompt is empty; give some text")
    if chat and not text.strip():
        raise PromptError("the prompt is empty (whitespace only); give some text, or --no-chat to send it as raw text")


def _turns(
    model, prompt: str | None, messages: Sequence[dict] | None, chat: bool | None, system: str | None
) -> list[dict] | None:
    """The chat turns a prompt is templated as, or None for raw text: turns (`messages`) where
    `chat` is not False, or a text as one user turn after `system` where `chat` says so (None: when
    the model is an instruct model). A template engine hands a turn on as a C string, which ends at
    the first NUL: the rest would be dropped without a word, so a NUL is refused."""
    chat = model.is_instruct if chat is None else chat
    if messages is not None and chat:
        turns, field = list(messages), "messages"
    elif prompt is None:
        raise PromptError("give a prompt or chat messages")
    else:
        check_text(prompt, chat)
        if not chat:
            return None
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        field = "prompt"
    for turn in turns:
        if "\0" in (turn["content"] or ""):
            raise PromptError(
                f"a {turn['role']} turn holds a NUL character (\\u0000), where the chat template would cut "
                "it short; remove it",
                field,
            )
    return turns


def text(
    model,
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    chat: bool | None = None,
    system: str | None = None,
) -> str:
    """What `model` reads for a prompt (as text, for a peer that tokenizes it itself): the chat
    template over its turns (_turns), or the raw text."""
    turns = _turns(model, prompt, messages, chat, system)
    return prompt if turns is None else model.tokenizer.apply_chat_template(turns)


# One call of the tokenizer: (text, add_special, special) as Tokenizer.encode takes them.
Piece = tuple[str, bool, bool]


def _template_pieces(tokenizer, turns: list[dict], special_in_turns: bool, tools: list | None = None) -> list[Piece]:
    """The chat template over `turns`, cut so that special tokens come from the template alone:
    each turn's content is tokenized as text, so a user who writes "<|im_end|>" sends those
    characters, never the control token that ends the turn (a prompt injection). Each content is
    rendered as a marker no text holds (a fresh nonce), and the template's text between markers is
    tokenized with its special tokens. `special_in_turns` tokenizes the whole text at once, the
    contents' special tokens included (the old behaviour, for those who want it). `tools` go to
    the template (tools.py), and a turn's tool calls with their arguments as objects; an empty
    content (an assistant turn of calls alone) stays empty for the template to see."""
    from .tools import history

    def render(turns: list[dict]) -> str:
        turns = history(turns)
        return tokenizer.apply_chat_template(turns, tools=tools) if tools else tokenizer.apply_chat_template(turns)

    if special_in_turns:
        return [(render(turns), True, True)]
    nonce = secrets.token_hex(8)
    marked = [
        {**turn, "content": f"\ue000{nonce}:{i}\ue001" if turn["content"] else ""} for i, turn in enumerate(turns)
    ]
    rendered = render(marked)
    pieces: list[Piece] = []
    start = 0  # the BOS (if the model adds one) opens the first piece of template text
    for match in re.finditer("\ue000" + nonce + ":(\\d+)\ue001", rendered):
        pieces.append((rendered[start : match.start()], start == 0, True))
        pieces.append((turns[int(match.group(1))]["content"], False, False))
        start = match.end()
    return pieces + [(rendered[start:], start == 0, True)]


def _check_size(tokenizer, pieces: list[Piece], n_ctx: int, field: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit the context: no token stands for more
    than M bytes (Tokenizer.max_token_bytes), so a piece of B bytes is at least ceil(B / M)
    tokens. Tokenizing megabytes takes seconds of CPU; counting bytes, milliseconds. A tokenizer
    that cannot bound M is not checked here (the count after tokenizing still is)."""
    sizes = [len(text.encode("utf-8", "surrogatepass")) for text, _, _ in pieces]
    if sum(sizes) < n_ctx:  # ceil(B / M) <= B: nothing to refuse, and M need not be worked out
        return
    longest = tokenizer.max_token_bytes()
    if not longest:
        return
    least = sum(-(-size // longest) for size in sizes)
    if least >= n_ctx:
        raise ContextOverflowError(
            f"the prompt has at least {least} tokens ({sum(sizes)} bytes, and no token of this model "
            f"stands for more than {longest}) but the context holds {n_ctx}; shorten it or raise --ctx",
            field,
            "context_length_exceeded",
        )


def tokens(
    model,
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict] | None = None,
    chat: bool | None = None,
    system: str | None = None,
    special_in_turns: bool = False,
    n_ctx: int | None = None,
    tools: list | None = None,
) -> list[int]:
    """The prompt's token ids: chat turns through the template (_template_pieces), raw text
    through the tokenizer (its special tokens parsed: who writes a raw prompt writes the template
    too, as with llama-server's and vLLM's completions), or token ids checked against the
    vocabulary. With `n_ctx`, a text too long to leave a token of room in that context is refused
    before it is tokenized (_check_size)."""
    field = "messages" if messages is not None else "prompt"
    if prompt is None or isinstance(prompt, str):
        turns = _turns(model, prompt, messages, chat, system)
        if turns is None:
            pieces: list[Piece] = [(prompt, True, True)]
        else:
            pieces = _template_pieces(model.tokenizer, turns, special_in_turns, tools)
        if n_ctx is not None:
            _check_size(model.tokenizer, pieces, n_ctx, field)
        ids = []
        for text, add_special, special in pieces:
            ids += model.tokenizer.encode(text, add_special=add_special, special=special)
    else:
        ids = [int(t) for t in prompt]
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise PromptError(f"'prompt' token id {bad} is outside the vocabulary (0..{model.vocab_size - 1})")
    if not ids:
        raise PromptError("the prompt is empty after tokenization", field)
    return ids


def prepare(
    model,
    prompt: str | Sequence[int] | None,
    config: GenerationConfig,
    *,
    messages: Sequence[dict] | None = None,
    limit: Limit = "end",
) -> tuple[list[int], GenerationConfig]:
    """(prompt token ids, the config to generate with): the prompt as `tokens` makes it (the
    config's chat and system say how a text is templated), checked against the context (a text
    far too long for it before it is tokenized), and the token budget settled by `limit`."""
    ids = tokens(
        model,
        prompt,
        messages=messages,
        chat=config.chat,
        system=config.system,
        special_in_turns=config.special_in_turns,
        n_ctx=model.n_ctx,
        tools=config.template_tools,
    )
    room = model.n_ctx - len(ids)
    if room < 1:
        raise ContextOverflowError(
            f"the prompt has {len(ids)} tokens but the context holds {model.n_ctx}; shorten it or raise --ctx",
            "messages" if messages is not None else "prompt",
            "context_length_exceeded",
        )
    if limit == "fit" and config.max_new_tokens > room:
        return ids, replace(config, max_new_tokens=room)
    if limit == "refuse" and config.max_new_tokens > room:
        raise ContextOverflowError(
            f"this model's context holds {model.n_ctx} tokens; the prompt has {len(ids)} and "
            f"{config.max_new_tokens} more were asked for (at most {room} fit)",
            "max_tokens",
            "context_length_exceeded",
        )
    return ids, config
