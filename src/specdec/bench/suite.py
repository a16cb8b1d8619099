"""The prompt suite of `specdec bench`: a JSONL file of prompts, each with an id and a category (and
optionally `messages`, a multi-turn conversation), some of them chosen; and each prompt's text as
a model receives it."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecdecError

DEFAULT_SUITE = Path(__file__).resolve().parents[3] / "benchmarks" / "prompts.jsonl"
CATEGORIES = ("code-generation", "code-editing", "summarization", "chat", "math")


def load_suite(path: Path, categories=None, per_category: int | None = None, limit: int | None = None):
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpecdecError(f"cannot read the prompt suite {path}: {exc.strerror}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            item["id"], item["category"], item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SpecdecError(f"{path}:{n}: each line needs a JSON object with id, category and prompt") from None
        if categories and item["category"] not in categories:
            continue
        prompts.append(item)
    if per_category:
        kept, seen = [], {}
        for item in prompts:
            seen[item["category"]] = seen.get(item["category"], 0) + 1
            if seen[item["category"]] <= per_category:
                kept.append(item)
        prompts = kept
    if limit:
        prompts = prompts[:limit]
    if not prompts:
        raise SpecdecError(f"no prompts selected from {path}")
    return prompts


def prompt_text(model, item: dict | str) -> str:
    """`item`'s prompt as `model` receives it (request.text): chat-templated for an instruct model
    (every turn of `messages` when the item has them), the raw `prompt` for a base model."""
    from ..request import text

    item = {"prompt": item} if isinstance(item, str) else item
    return text(model, item["prompt"], messages=item.get("messages"))
