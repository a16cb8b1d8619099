"""What a request's flags ask for: its prompt (--prompt, --prompt-file or stdin; in batch mode
a prompt a line) and its GenerationConfig."""

from __future__ import annotations

import json
import sys

from ..errors import SpecdecError
from ..request import check_text


def _read_prompt(args, demo: str | None = None) -> str:
    """The prompt from --prompt, --prompt-file or stdin. `demo` (compare's built-in prompt) stands in
    when none is given and stdin is a terminal, closed or empty, and says so on stderr."""
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as f:
                text = _utf8(f.read(), f"--prompt-file {args.prompt_file}")
        except OSError as exc:
            raise SpecdecError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
    else:
        stdin = sys.stdin
        data = b"" if stdin is None or stdin.closed or stdin.isatty() else _read_stdin(stdin)
        if not data:
            if demo is not None:
                print(
                    "specdec: using the built-in demo prompt (give --prompt, --prompt-file or pipe one on stdin)",
                    file=sys.stderr,
                )
                return demo
            raise SpecdecError("no prompt: give --prompt, --prompt-file, or pipe it on stdin")
        text = _utf8(data, "stdin")
    check_text(text, chat=args.chat is not False)  # request.py's rule, before any model loads
    return text


def _read_stdin(stdin) -> bytes:
    buffer = getattr(stdin, "buffer", None)
    return buffer.read() if buffer is not None else stdin.read().encode("utf-8", "surrogateescape")


def _utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecdecError(f"{source} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def _batch_prompts(args) -> list[str]:
    """Batch mode: a prompt per non-empty line; in a .jsonl file, the "prompt" field of each line."""
    text = _read_prompt(args)
    if args.prompt_file and args.prompt_file.endswith(".jsonl"):
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SpecdecError(
                    f'{args.prompt_file}:{n}: each line needs a JSON object with a "prompt" field'
                ) from None
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecdecError("no prompts: every line is empty")
    return prompts


def _config(args):
    from ..config import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        chat=args.chat,
        system=args.system,
        special_in_turns=args.special_in_turns,
        logprobs=args.logprobs,
        reproducible=args.reproducible,
        verification=args.verification,
        **_constraint(args),
    )


def _constraint(args) -> dict:
    """--json-schema (a file or the schema itself) and --grammar (a GBNF file; .lark: Lark) as
    GenerationConfig's response_format / grammar."""
    from ..grammar import GrammarSpec

    schema, grammar = getattr(args, "json_schema", None), getattr(args, "grammar", None)
    if schema is not None and grammar is not None:
        raise SpecdecError("give --json-schema or --grammar, not both")
    if schema is not None:
        text = schema if schema.lstrip()[:1] in ("{", "[") else _file(schema, "--json-schema")
        try:
            value = json.loads(text)
        except ValueError as e:
            raise SpecdecError(f"--json-schema {_short(schema)}: not valid JSON ({e})") from None
        spec = GrammarSpec.json_schema(value, "--json-schema")
        return {
            "response_format": {"type": "json_schema", "json_schema": {"name": "cli", "schema": json.loads(spec.text)}}
        }
    if grammar is not None:
        text = _file(grammar, "--grammar")
        return {"grammar": GrammarSpec("lark" if grammar.endswith(".lark") else "gbnf", text)}
    return {}


def _file(path: str, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            return _utf8(f.read(), f"{flag} {path}")
    except OSError as exc:
        raise SpecdecError(f"cannot read {flag} {path}: {exc.strerror}") from None


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."
