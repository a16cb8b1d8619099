"""The request bodies the server takes, as pydantic models (FastAPI's own; no new dependency): the
shape /openapi.json and /docs describe, and the type and range check of every field. protocol.py
words a failed check as the OpenAI-style 400 that names the field (`refusal`), and does the checks
that span fields or need the server's state (the model served, the drafts offered).

Strict: a string is not a number, true is not 1, 2.0 is not an integer. Fields the server accepts
only with the value that asks for nothing (protocol._UNSUPPORTED: n, tools, logit_bias, ...) are
typed Any here and checked there. Unknown fields are refused there too, all of them in one message.
"""

from __future__ import annotations

from typing import Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import MAX_LOGPROBS
from ..drafters.base import MAX_DRAFT_TOKENS, MAX_DRAFT_WIDTH

MAX_SEED = 2**64 - 1  # numpy's generators' range, as the CLI's --seed


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # (unknown fields: protocol._check_fields)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str = Field(description="system, developer (as system), user, assistant or tool")
    content: str | list[TextPart] | None = Field(None, description="may be empty on an assistant's tool calls")
    name: str | None = Field(None, description="accepted; the chat template decides whether it shows")
    tool_calls: list[dict] | None = Field(None, description="an assistant's earlier calls (arguments as JSON text)")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")


class StreamOptions(_Body):
    include_usage: bool | None = None


class Speculative(_Body):
    """The request's own speculation, among what the server loaded (spec.parse_request)."""

    draft: str = Field("auto", description="auto, ngram, suffix, none, the loaded draft model's name, or head")
    k: int | None = Field(None, ge=1, le=MAX_DRAFT_TOKENS, description="draft tokens a step of a fixed drafter")
    width: int | None = Field(None, ge=1, le=MAX_DRAFT_WIDTH, description="prompt lookup's or the suffix cache's tree")


def _refused(description: str) -> Any:
    return Field(None, description=f"accepted only when it asks for nothing: {description}")


class _Request(_Body):
    """What chat and text completions share, in the order they are checked."""

    model: str | None = Field(None, description="the served model's name (GET /v1/models); default: it")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    store: bool | None = Field(None, description="accepted and ignored: nothing is stored")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    max_tokens: int | None = Field(None, ge=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False, description="0: greedy (default)")
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    stop: str | list[str] | None = Field(None, description="at most 16 non-empty strings")
    speculative: Speculative | None = None
    return_tokens: bool | None = Field(None, description="llama-server's: the generated token ids as well")
    response_format: Any = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}'
    )
    json_schema: Any = Field(None, description="llama-server's: a JSON Schema the output follows")
    grammar: str | None = Field(None, description="llama-server's: a GBNF grammar the output follows")
    n: Any = _refused("1")
    frequency_penalty: Any = _refused("0")
    presence_penalty: Any = _refused("0")
    logit_bias: Any = _refused("{}")


class ChatRequest(_Request):
    """POST /v1/chat/completions."""

    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens by its newer name")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    messages: list[Message] = Field(min_length=1)
    tools: Any = Field(None, description='[{"type": "function", "function": {"name", "description", "parameters"}}]')
    tool_choice: Any = Field(None, description='none, auto (default with tools), required or {"type": "function", ...}')
    parallel_tool_calls: bool | None = Field(None, description="more than one call in a turn (default: true)")
    functions: Any = _refused("[]")
    function_call: Any = _refused("none")
    audio: Any = _refused("absent")
    modalities: Any = _refused('["text"]')
    prediction: Any = _refused("absent")


class CompletionRequest(_Request):
    """POST /v1/completions: raw text (no chat template) or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a list of one of either"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Any = _refused("1")
    echo: Any = _refused("false")
    suffix: Any = _refused('""')


def first_error(model: type[_Request], body: dict) -> tuple[str, str] | None:
    """The first field of `body` that fails `model`'s checks, worded as protocol's errors are:
    (the field, the message); None where the body passes."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0])
        if len(error["loc"]) > 1:  # within a field of parts (protocol words these by their own checks)
            return name, f"'{'.'.join(map(str, error['loc']))}': {error['msg']}"
        return name, _wording(name, error["type"], body.get(name), model.model_fields[name].metadata)
    return None


def _wording(name: str, kind: str, value, bounds: list) -> str:
    if kind == "int_type":
        return f"'{name}' must be an integer, got {value!r}"
    if kind == "bool_type":
        return f"'{name}' must be true or false, got {value!r}"
    if kind in ("float_type", "finite_number"):
        return f"'{name}' must be a number, got {value!r}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than"):
        low = next((b for b in bounds if isinstance(b, (Ge, Gt))), None)
        high = next((b.le for b in bounds if isinstance(b, Le)), None)
        opened = "(" if isinstance(low, Gt) else "["
        low = low.gt if isinstance(low, Gt) else low.ge
        where = f">= {low}" if high is None else f"in {opened}{low}, {high}]"
        return f"'{name}' must be {where}, got {value}"
    return f"'{name}' is not valid here, got {value!r}"
