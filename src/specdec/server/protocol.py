"""The OpenAI API's request bodies -> what the engine runs, and results -> response bodies.

Pure functions over JSON-like values: no HTTP, no models. Every field a body may carry is listed
here; a field we cannot honour is a RequestError (400) that names it, unless it holds the value
that asks for nothing (`n: 1`, `logprobs: false`, `tools: []`, `presence_penalty: 0`, ...).
Unknown fields are refused too: a silently ignored field is a wrong answer the client cannot see.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

from pydantic import BaseModel

from ..config import GenerationConfig
from ..errors import FieldError, SpecdecError
from ..models.chat import ROLES
from ..request import Limit, finish_reason
from ..sampling import TokenLogprob
from ..spec import DraftSpec, parse_request
from ..stats import GenerationStats
from .schema import ChatRequest, CompletionRequest, first_error

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; llama-server any number)
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's and vLLM's default max_tokens for /v1/completions
UNBOUNDED = 2**31 - 1  # chat's max_tokens when none is given: the context is the limit


class RequestError(SpecdecError):
    """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class Job:
    """One parsed request: the prompt (chat messages, text, or token ids), its generation config,
    its speculation, and how to answer."""

    kind: str  # "chat" | "completion"
    model: str
    messages: list[dict] | None = None  # chat: [{"role", "content"}], roles normalised
    prompt: str | list[int] | None = None  # completion: text or token ids
    config: GenerationConfig = field(default_factory=GenerationConfig)
    # how max_new_tokens meets the context (request.Limit): "refuse" a request whose max_tokens
    # do not fit; "fit" where none is given: the default (16 for completions, none for chat) or as
    # many as the context leaves, whichever is fewer
    limit: Limit = "fit"
    policy: DraftSpec | None = None  # kind and k (no model: 'model' is the one loaded); None: the default
    stream: bool = False
    include_usage: bool = False
    return_tokens: bool = False  # llama-server's extension: the generated token ids


# -- what is refused unless it asks for nothing --------------------------------------------------


def _no_op(v) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == "none"


# field -> (the values that ask for nothing, why we cannot do more)
_UNSUPPORTED = {
    "n": (lambda v: v is None or v == 1, "only n = 1 is supported (one choice per request)"),
    "best_of": (lambda v: v is None or v == 1, "only best_of = 1 is supported"),
    "echo": (_no_op, "echo is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    "functions": (_no_op, "functions (function calling) are not supported"),
    "function_call": (_no_op, "functions (function calling) are not supported"),
    "frequency_penalty": (
        _no_op,
        "frequency_penalty is not supported (it would change the target's "
        "distribution, which speculative decoding reproduces exactly)",
    ),
    "presence_penalty": (
        _no_op,
        "presence_penalty is not supported (it would change the target's "
        "distribution, which speculative decoding reproduces exactly)",
    ),
    "logit_bias": (_no_op, "logit_bias is not supported"),
    "audio": (_no_op, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "prediction": (_no_op, "predicted outputs are not supported (the drafter predicts by itself)"),
}


def _check_fields(body: dict, model: type[BaseModel]) -> None:
    unknown = sorted(set(body) - set(model.model_fields))
    if unknown:
        raise RequestError(
            f"unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}", unknown[0], "unsupported_field"
        )
    for name, (ok, why) in _UNSUPPORTED.items():
        if name in body and not ok(body[name]):
            raise RequestError(f"'{name}': {why}", name, "unsupported_value")


def _check_types(model: type[BaseModel], body: dict, draft_names: dict[str, str]) -> None:
    """Every field's type and range (schema.py's models); a field of parts (stop, metadata,
    stream_options, speculative, messages, prompt) is worded by its own check below."""
    found = first_error(model, body)
    if found is None:
        return
    name, message = found
    worded = {
        "stop": lambda: _stop(body),
        "metadata": lambda: _metadata(body),
        "stream_options": lambda: _stream_options(body),
        "speculative": lambda: _policy(body, draft_names),
        "messages": lambda: _messages(body.get("messages")),
        "prompt": lambda: _prompt(body.get("prompt")),
    }
    if name in worded:
        worded[name]()  # raises its own words
    raise RequestError(message, name)


# -- the parts every request shares ---------------------------------------------------------------


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"'stop' must be a string or a list of strings, got {v!r}", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"'stop' holds at most {MAX_STOP} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise RequestError("'stop' strings must not be empty", "stop")
    return tuple(stops)


def _policy(body: dict, draft_names: dict[str, str]) -> DraftSpec | None:
    """The request's own speculation (spec.parse_request), or None where it asks for none."""
    try:
        return parse_request(body.get("speculative"), draft_names)
    except FieldError as exc:
        raise RequestError(str(exc), exc.param, exc.code) from None


def _common(
    body: dict,
    kind: str,
    model_names: tuple[str, ...],
    draft_names: dict[str, str],
    max_tokens_fields: tuple[str, ...],
    default_max_tokens: int | None = None,
) -> Job:
    """The fields chat and completions share, their types already checked (_check_types).
    `default_max_tokens` stands where no max_tokens is given (None: as many as fit, settled when
    the prompt is tokenized)."""
    model = body.get("model")
    if model is not None and model not in model_names:
        raise RequestError(
            f"model {model!r} is not served here; this server serves {model_names[0]!r} (see GET /v1/models)",
            "model",
            "model_not_found",
        )
    include_usage = _stream_options(body)
    max_tokens = None
    for name in max_tokens_fields:
        v = body.get(name)
        if v is not None:
            if max_tokens is not None and v != max_tokens:
                raise RequestError("give max_tokens or max_completion_tokens, not two different values", name)
            max_tokens = v
    top_k, temperature, top_p, min_p = (body.get(name) for name in ("top_k", "temperature", "top_p", "min_p"))
    stop = _stop(body)
    try:
        config = GenerationConfig(
            # without max_tokens: the default, or as many as the context leaves (request.prepare's "fit")
            max_new_tokens=max_tokens or default_max_tokens or UNBOUNDED,
            temperature=0.0 if temperature is None else float(temperature),
            top_k=0 if top_k in (None, -1) else top_k,  # -1: vLLM's "off"
            top_p=1.0 if top_p is None else float(top_p),
            min_p=0.0 if min_p is None else float(min_p),
            seed=body.get("seed"),
            stop=stop,
            response_format=body.get("response_format"),
            grammar=_grammar(body),
            tools=body.get("tools"),
            tool_choice=body.get("tool_choice"),
            parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        )
    except RequestError:
        raise
    except FieldError as exc:
        raise RequestError(str(exc), exc.param, exc.code) from None
    except SpecdecError as exc:
        raise RequestError(str(exc)) from None
    return Job(
        kind,
        model or model_names[0],
        config=config,
        limit="fit" if max_tokens is None else "refuse",
        policy=_policy(body, draft_names),
        stream=bool(body.get("stream")),
        include_usage=include_usage,
        return_tokens=bool(body.get("return_tokens")),
    )


def _grammar(body: dict):
    """llama-server's top-level json_schema or grammar (GBNF), as a grammar.GrammarSpec."""
    from ..grammar import GrammarSpec

    schema, grammar = body.get("json_schema"), body.get("grammar")
    if schema is not None and grammar is not None:
        raise RequestError("give json_schema or grammar, not both", "json_schema")
    if schema is not None:
        return GrammarSpec.json_schema(schema, "json_schema")
    return grammar


def _stream_options(body: dict) -> bool:
    """stream_options.include_usage (only with "stream": true)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise RequestError("'stream_options' is only allowed with \"stream\": true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(f"'stream_options' takes only include_usage, got {options!r}", "stream_options")
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise RequestError(f"'include_usage' must be true or false, got {usage!r}", "include_usage")
    return bool(usage)


def _metadata(body: dict) -> None:
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise RequestError("'metadata' must be an object of string values", "metadata")


def parse_chat(body, model_names: tuple[str, ...], draft_names: dict[str, str]) -> Job:
    """POST /v1/chat/completions."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(body, ChatRequest)
    _check_types(ChatRequest, body, draft_names)
    job = _common(body, "chat", model_names, draft_names, ("max_tokens", "max_completion_tokens"))
    top = body.get("top_logprobs")
    if body.get("logprobs"):
        job.config = replace(job.config, logprobs=top or 0)
    elif top:
        raise RequestError("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    job.messages = _messages(body.get("messages"))
    return job


def _messages(messages) -> list[dict]:
    """Chat turns, each {"role", "content"} with its role normalised (models.chat.ROLES); a tool's
    result ({"role": "tool", "tool_call_id", "content"}) and an assistant's tool_calls (its content
    then may be empty) as the chat template takes them; a message's `name` is accepted and left
    to the template."""
    if not isinstance(messages, list) or not messages:
        raise RequestError('\'messages\' must be a non-empty list of {"role", "content"} objects', "messages")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with role and content", where)
        role = m.get("role")
        # (a null field is no field: the openai SDK sends back its own message objects' refusal: null)
        extra = sorted(
            k for k in set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"} if m[k] is not None
        )
        if extra:
            raise RequestError(
                f"{where}: unsupported field(s) {', '.join(extra)} (audio and refusals are not supported)",
                f"{where}.{extra[0]}",
                "unsupported_field",
            )
        if role not in ROLES and role != "tool":
            raise RequestError(
                f"{where}.role must be one of {', '.join([*ROLES, 'tool'])}; got {role!r}", f"{where}.role"
            )
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise RequestError(f"{where}: only an assistant message has tool_calls", f"{where}.tool_calls")
        if (m.get("tool_call_id") is not None) != (role == "tool"):
            raise RequestError(f"{where}: a tool message (and only one) has a tool_call_id", f"{where}.tool_call_id")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestError(f"{where}.name must be a string", f"{where}.name")
        empty_ok = bool(calls) and m.get("content") is None
        turn = {"role": ROLES.get(role, role), "content": "" if empty_ok else _content(m.get("content"), where)}
        if calls:
            turn["tool_calls"] = _tool_calls(calls, where)
        if role == "tool":
            turn["tool_call_id"] = str(m["tool_call_id"])
        turns.append(turn)
    return turns


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant turn's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise RequestError(
                f'{where}.tool_calls[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}} '
                "with arguments a JSON string",
                f"{where}.tool_calls",
            )
        out.append(
            {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}
        )
    return out


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(
                    f"{where}.content[{j}]: only text parts are supported, got {kind!r}", f"{where}.content"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}.content must be a string or a list of text parts, got {content!r}", f"{where}.content")


def parse_completion(body, model_names: tuple[str, ...], draft_names: dict[str, str]) -> Job:
    """POST /v1/completions: the prompt is raw text (no chat template) or token ids."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(body, CompletionRequest)
    _check_types(CompletionRequest, body, draft_names)
    job = _common(body, "completion", model_names, draft_names, ("max_tokens",), COMPLETIONS_MAX_TOKENS)
    job.prompt = _prompt(body.get("prompt"))
    if body.get("logprobs") is not None:
        job.config = replace(job.config, logprobs=body["logprobs"])
    return job


def _prompt(prompt) -> str | list[int]:
    """A completion's prompt: text or token ids (a list of one of either: a batch of one)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' is empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise RequestError(
            "'prompt' holds several prompts; send one per request (n > 1 prompts are not supported)",
            "prompt",
            "unsupported_value",
        )
    else:
        raise RequestError("'prompt' must be a non-empty string or a list of token ids", "prompt")
    return prompt


# -- responses ------------------------------------------------------------------------------------


def speculative_body(stats: GenerationStats, policy: DraftSpec) -> dict:
    """The `speculative` object every response carries (vLLM's spec-decode metrics, per request)."""
    return {
        "policy": policy.label,
        "num_drafts": stats.drafted_at[0] if stats.drafted_at else 0,  # steps that drafted
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 6),
        "drafted_by_position": list(stats.drafted_at),
        "accepted_by_position": list(stats.accepted_at),
        "acceptance_by_position": [round(a, 6) for a in stats.acceptance_by_position],
        "mean_accepted_length": round(stats.mean_accepted_length, 6),
        "steps": stats.steps,
        "decisions": dict(stats.decisions),
    }


def usage_body(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        # OpenAI's field (llama-server and vLLM fill it too): prompt tokens found in a kept cache
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def fingerprint(model: str) -> str:
    """system_fingerprint: the build and the model that answered (OpenAI's field for telling a
    change of backend from a change of sampling)."""
    from .. import __version__

    return f"specdec-{__version__}-{model}"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def response_body(
    job: Job,
    id: str,
    created: int,
    text: str,
    tokens: list[int],
    finish: str,
    stats: GenerationStats,
    policy: DraftSpec,
    logprobs: list[TokenLogprob] | None = None,
    token_bytes: Callable[[int], bytes] | None = None,
) -> dict:
    """The whole (non-streaming) response. `logprobs` (when asked for) are shown with
    `token_bytes`, the tokenizer's."""
    lp = logprobs_body(job.kind, logprobs, token_bytes) if logprobs is not None else None
    if job.kind == "chat":
        content, calls = tool_calls(job, text)
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": lp,
            "finish_reason": "tool_calls" if calls and finish in ("eog", "stop") else finish_reason(finish),
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason(finish)}
    if job.return_tokens:
        choice["tokens"] = list(tokens)
    return {
        "id": id,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": created,
        "model": job.model,
        "system_fingerprint": fingerprint(job.model),
        "choices": [choice],
        "usage": usage_body(stats),
        "speculative": speculative_body(stats, policy),
    }


def tool_calls(job: Job, text: str) -> tuple[str | None, list[dict]]:
    """(content, OpenAI's tool_calls) of a chat answer: the calls read back (tools.parse) where
    the request has tools to call, else the text as it is."""
    if job.config.tool_choice_word == "none":
        return text, []
    from ..tools import parse

    return parse(text)


def tool_call_chunks(job: Job, id: str, created: int, calls: list[dict]) -> list[dict]:
    """The streamed form of `calls`: a chunk each, delta.tool_calls with its index, id, name and
    whole arguments."""
    chunks = []
    for i, call in enumerate(calls):
        chunk = chunk_body(job, id, created)
        chunk["choices"][0]["delta"] = {"tool_calls": [{"index": i, **call}]}
        chunks.append(chunk)
    return chunks


def chunk_body(
    job: Job,
    id: str,
    created: int,
    text: str | None = None,
    finish: str | None = None,
    role: bool = False,
    tokens: list[int] | None = None,
    logprobs: list[TokenLogprob] | None = None,
    token_bytes: Callable[[int], bytes] | None = None,
) -> dict:
    """One streamed chunk: a piece of text, the first (role) chunk, or the last (finish_reason);
    `logprobs`: those of the tokens generated since the last chunk."""
    lp = logprobs_body(job.kind, logprobs, token_bytes) if logprobs else None
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish_reason(finish) if finish else None,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": text or "",
            "logprobs": lp,
            "finish_reason": finish_reason(finish) if finish else None,
        }
        obj = "text_completion"
    if tokens is not None:
        choice["tokens"] = list(tokens)
    return {
        "id": id,
        "object": obj,
        "created": created,
        "model": job.model,
        "system_fingerprint": fingerprint(job.model),
        "choices": [choice],
    }


LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for a log-probability of -inf (JSON has no infinity)


def logprobs_body(kind: str, entries: list[TokenLogprob], token_bytes: Callable[[int], bytes]) -> dict:
    """Log-probabilities as OpenAI shows them: chat's {"content": [{token, logprob, bytes,
    top_logprobs}]}; completions' {tokens, token_logprobs, top_logprobs, text_offset}. A token's
    text is its bytes as UTF-8 (a token holding part of a character shows U+FFFD; `bytes` has it whole)."""

    def text(token: int) -> str:
        return token_bytes(token).decode("utf-8", "replace")

    def value(lp: float) -> float:
        return max(lp, LOGPROB_FLOOR)

    if kind == "chat":

        def item(token: int, lp: float) -> dict:
            return {"token": text(token), "logprob": value(lp), "bytes": list(token_bytes(token))}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}
    tokens = [text(e.token) for e in entries]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    tops = []
    for e in entries:  # keyed by text: where two tokens show one text, the likelier one's (first)
        top: dict[str, float] = {}
        for t, lp in e.top:
            top.setdefault(text(t), value(lp))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [value(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def now() -> int:
    return int(time.time())
