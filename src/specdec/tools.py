"""Tools (function calling) as OpenAI's API has them, for models whose chat template writes a tool
call as a Hermes block: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5,
Hermes and the many templates that copied them).

The tools are rendered by the model's own chat template (it takes `tools`), and the grammar
(grammar.py) keeps every call well formed: `tool_choice` "required" or a named function forces a
call from the first token; "auto" lets the model write text, and the grammar wakes at the
call's opening (a lazy grammar, as llama-server's): from `<tool_call>` on, the block must be a
call of a given function with arguments that follow its parameters' schema. The output is read
back into OpenAI's `tool_calls`; a block that does not parse (cut by max_tokens) stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .errors import FieldError
from .grammar import JSON_OPTIONS, TAG_MARKS, TOOL_TAGS, GrammarSpec

OPEN, CLOSE = TOOL_TAGS
CHOICES = ("none", "auto", "required")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def check_tools(tools: Any) -> list[dict]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise FieldError('tools must be a list of {"type": "function", "function": {...}}', "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise FieldError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name or ""):
            raise FieldError(f"{where}.function.name must be 1-64 letters, digits, _ . or -; got {name!r}", "tools")
        if name in names:
            raise FieldError(f"{where}.function.name {name!r} is given twice", "tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise FieldError(f"{where}.function.parameters must be a JSON Schema object", "tools")
    return tools


def check_choice(choice: Any, tools: list[dict]) -> str:
    """tool_choice as a word: none, auto, required, or the name of the one function to call."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise FieldError(f"tool_choice must be none, auto, required or a function; got {choice!r}", "tool_choice")
        if choice == "required" and not tools:
            raise FieldError('tool_choice "required" needs tools', "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise FieldError('tool_choice must be a word or {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise FieldError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return name


def grammar(tools: list[dict], choice: str, parallel: bool = True) -> GrammarSpec | None:
    """The Lark grammar (llguidance's, with %json) of the output that `choice` allows: None for
    none; a call (or calls, with `parallel`) from the first token for required or a named
    function; text or calls, the call held to its schema from its opening on, for auto."""
    if choice == "none" or not tools:
        return None
    chosen = [t for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = dict(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, **{"x-guidance": JSON_OPTIONS})
    calls = 'call ("\\n" call)*' if parallel else "call"
    lines = [
        f"calls: {calls}",
        f'call: {TAG_MARKS[0]} "\\n" %json {json.dumps(schema)} "\\n" {TAG_MARKS[1]}',
    ]
    if choice == "auto":
        lines = ["start: TEXT | TEXT? calls", "TEXT: /(.|\\n)+/", *lines]
    else:
        lines = ["start: calls", *lines]
    return GrammarSpec("tool_lark", "\n".join(lines) + "\n")


def parse(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a model's output: each well-formed block a call of OpenAI's shape
    (arguments as a JSON string), the text around them the content (None where only calls);
    a block that does not parse stays in the content."""
    calls, content, start = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            body = json.loads(m.group(1))
            name, arguments = body["name"], body.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            continue
        content.append(text[start : m.start()])
        start = m.end()
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    content.append(text[start:])
    rest = "".join(content).strip()
    return (rest or None) if calls else text, calls


def held_back(text: str) -> int:
    """How many characters at the end of streamed `text` to hold back: from a call's opening on
    (it is read back as tool_calls at the end), or a tail that may yet become one."""
    at = text.find(OPEN)
    if at >= 0:
        return len(text) - at
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def history(messages: list[dict]) -> list[dict]:
    """Chat turns as a template that knows tools reads them: an assistant's tool_calls with their
    arguments as objects (OpenAI sends JSON strings; templates write them with tojson)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
