"""Training data the target writes itself (`specdec train --data self`): chat requests made from
what this machine already has, answered by the target through its own chat template.

A head drafts the target's answers, so the text it learns from should be answers: the target's
greedy tokens after a chat prompt, in its own words and format (Medusa-2 and EAGLE train on
data the target regenerates for the same reason). The requests come from templates over the
same sources as the default text data (train.features.default_sources): the standard library's
documented functions (write one; explain one; a two-turn exchange whose first answer is the
function's real source), its modules' docstrings (what is it for), prose paragraphs of those
docstrings and of the packages' documentation (summarise, translate, answer from a passage),
and arithmetic word problems drawn from a seeded generator. Never our evaluation prompts or suites.

Each conversation is one window of features (train.features: tokens, the target's greedy next
token at each, the final-norm hidden states), taken while the target answers: the prompt's in
its prefill, the answer's one decode step at a time, `rows` answers at once (ROWS on a CPU, GPU_ROWS
on a GPU: docs/results/provenance.md). A conversation's file
is written whole when its answer ends, so Ctrl-C loses only the answers under way, and the same
command resumes; conversation i is the same request for every budget, so budgets share a cache
and a held-out set (every HELD_OUT_EVERY-th conversation).

Where the user has requests of their own (a server's logged chat requests, a ShareGPT-style set:
`--requests FILE`, read_requests), those are asked instead of the templates, each once, in the
file's order: the head then learns the answers its users will ask for, and its held-out agreement
is measured on requests of theirs it never saw.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import PromptError, SpecdecError
from ..models.chat import ROLES as CHAT_ROLES
from ..paths import write_atomically
from ..sampling import SamplingParams, logits_to_probs, sample
from .features import MAX_FILE_BYTES, Progress, features_folder

ANSWER_TOKENS = 256  # an answer is cut here (a summary or a function fits; a long essay is cut)
PROMPT_TOKENS = 768  # a longer request is skipped (a passage of a few paragraphs fits)
FOLLOW_TOKENS = 64  # a follow-up turn's template and text, at most
N_CTX = PROMPT_TOKENS + 2 * ANSWER_TOKENS + FOLLOW_TOKENS  # what a row must hold: two answers
FOLLOW_SHARE = 0.4  # conversations that go on to a second turn, asked about the target's own answer
SYSTEM_SHARE = 0.25  # conversations that open with a system message
ROWS = 16  # answers decoded together on a CPU, each in a KV stream of its own (load the target with trees=False)
GPU_ROWS = 64  # on a GPU: docs/results/provenance.md#answer_tokens-prompt_tokens-rows-gpu_rows
MAX_SKIPPED = 1000  # requests in a row too long for a row: the sources give none that fit
VERSION = "self v2"  # names the templates in the cache key: a change of wording is a new data set
INVENT_TOKENS = 96  # an invented request that has not ended its turn by here is dropped
INVENT_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)  # Magpie samples at 1.0; the nucleus drops the tail
INVENTED = "queries.json"  # the invented requests, by conversation index, in the features folder

LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Chinese", "Japanese")
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun")


@dataclass
class Pools:
    """What the requests are made from, parsed from the source files."""

    functions: list[tuple[str, str, str, str]] = field(default_factory=list)  # (module, signature, doc, source)
    modules: list[tuple[str, str]] = field(default_factory=list)  # (module, first docstring line)
    paragraphs: list[str] = field(default_factory=list)
    passages: list[str] = field(default_factory=list)  # 2-4 consecutive prose paragraphs of one file


def _module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if "lib" not in parts:  # a file of --data: its name
        return path.stem
    parts = parts[parts.index("lib") + 2 :]  # .../lib/python3.X/json/decoder.py -> json.decoder
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(p for p in parts if p != "site-packages")


def _prose(paragraph: str) -> bool:
    """A paragraph of running text: no code block, table, directive or heading, mostly letters."""
    if not 200 <= len(paragraph) <= 1200 or paragraph.lstrip()[:1] in "#|.`:-*=+>[<!{":
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    shouted = sum(c.isupper() for c in paragraph) > 0.2 * letters
    legal = any(word in paragraph.lower() for word in ("warrant", "copyright", "licen"))
    return letters >= 0.85 * len(paragraph) and paragraph.count(". ") >= 1 and not shouted and not legal


def read_pools(files: list[Path], seed: int = 0, limit: int = 400) -> Pools:
    """Up to `limit` items of each kind, from the files in a seeded shuffle."""
    pools = Pools()
    order = list(files)
    random.Random(seed).shuffle(order)
    for path in order:
        if min(len(pools.functions), len(pools.modules), len(pools.paragraphs)) >= limit:
            break
        try:
            text = path.read_bytes()[:MAX_FILE_BYTES].decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if path.suffix == ".py":
            _read_python(text, _module_name(path), pools, limit)
        else:
            _read_prose(text, pools, limit)
    return pools


def _read_prose(text: str, pools: Pools, limit: int) -> None:
    """Prose paragraphs, and runs of 2-4 consecutive ones (a passage, as long texts are asked about)."""
    run: list[str] = []
    for paragraph in [*re.split(r"\n\s*\n", text), ""]:
        paragraph = " ".join(paragraph.split())
        if _prose(paragraph):
            if len(pools.paragraphs) < limit:
                pools.paragraphs.append(paragraph)
            run.append(paragraph)
            continue
        if len(run) >= 2 and len(pools.passages) < limit:
            pools.passages.append("\n\n".join(run[:4])[:2400])
        run = []


def _read_python(text: str, module: str, pools: Pools, limit: int) -> None:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    public = module and not any(part.startswith("_") for part in module.split("."))
    doc = ast.get_docstring(tree)
    if public and doc and len(pools.modules) < limit:
        pools.modules.append((module, doc.strip().splitlines()[0]))
    _read_prose(doc or "", pools, limit)  # a module's documentation is prose too
    taken = 0
    for node in tree.body:
        if taken >= 2 or len(pools.functions) >= limit:  # two a module: many modules teach more
            return
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        source = ast.get_source_segment(text, node)
        if not doc or len(doc) < 40 or not source or not 4 <= source.count("\n") <= 40:
            continue
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        signature = f"{node.name}({ast.unparse(node.args)})"
        pools.functions.append((module, signature, summary, source))
        taken += 1


def _math(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    a, b, c = rng.randint(3, 60), rng.randint(2, 30), rng.randint(2, 12)
    problems = (
        f"{name} drives at {a + 30} km/h for {c} hours, then at {b + 20} km/h for {rng.randint(1, 5)} hours. "
        "How far does the trip go in all? Show your working.",
        f"A shop sells notebooks at {a} cents each. {name} buys {c} notebooks and pays with a "
        f"{rng.choice((5, 10, 20))}-dollar note. How much change is there? Explain step by step.",
        f"Solve for x: {c}x + {a} = {a + c * b}. Explain each step.",
        f"What is {rng.choice((5, 12, 15, 20, 25, 40))}% of {a * 10}? Explain how you got it.",
        f"A rectangle is {c} m wide and {a} m long. What are its area and its perimeter?",
        f"{name} saves {a} dollars a week for {b} weeks and then spends {c * 10} dollars. "
        "How much is left? Think step by step.",
        f"Is {a * 7 + 1} a prime number? Explain how to check.",
    )
    return rng.choice(problems)


# Each kind of request in several wordings. The last wording of each is kept for the held-out
# conversations (every HELD_OUT_EVERY-th): their agreement then measures wordings a head never saw,
# as real prompts are, instead of the training templates again.
PHRASES = {
    "code": (
        "Write a Python function `{signature}` that does this: {summary}",
        "Implement `{signature}` in Python. {summary}",
        "I need a Python function, `{signature}`. It should do the following: {summary} Please include a docstring.",
        "Can you code `{signature}`? Here is what it must do: {summary}",
    ),
    "explain": (
        "Explain what this Python function does.\n\n```python\n{source}\n```",
        "```python\n{source}\n```\n\nWhat does this code do, step by step?",
        "Can you walk me through this function and point out anything surprising?\n\n```python\n{source}\n```",
        "Review this code. Is there a bug or something you would change?\n\n```python\n{source}\n```",
    ),
    "question": (
        "What is the Python module `{module}` for? Give a short example of using it.",
        "I found `{module}` in Python's standard library ({line}). When would I use it, and how?",
        "Explain `{module}` to someone new to Python.",
        "How do I use {module} in Python? Show me a typical use.",
    ),
    "summarise": (
        "Summarise the following text in two or three sentences.\n\n{text}",
        "{text}\n\nGive me a short summary of the text above.",
        "Write a one-paragraph summary of this:\n\n{text}",
        "TL;DR of the following, please.\n\n{text}",
    ),
    "translate": (
        "Translate the following text into {language}.\n\n{text}",
        "Please translate into {language}:\n\n{text}",
        "{text}\n\nTranslate the text above into {language}.",
        "How would you say this in {language}?\n\n{text}",
    ),
    "passage": (
        "Read the passage below and answer.\n\n{text}\n\nQuestion: {ask}",
        "{text}\n\nBased only on the text above: {ask}",
        "Context:\n{text}\n\nUsing the context, answer this question. {ask}",
        "Here is some documentation.\n\n{text}\n\n{ask}",
    ),
}
ASKS = (
    "What is this passage about?",
    "List the main points of this passage.",
    "What problem does it describe, and what is the solution?",
    "Who would need this, and why?",
)
SYSTEMS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are an expert Python developer.",
    "You are a patient teacher who explains things clearly.",
)
FOLLOW_UPS = (
    "Can you make that shorter?",
    "Give me an example.",
    "Why is that?",
    "Now explain it to a beginner.",
    "Can you put that as a bulleted list?",
    "Thanks! What would you change to make it better?",
    "Are there any pitfalls I should know about?",
    "Can you say more about the second point?",
)


def request(
    index: int, pools: Pools, seed: int = 0, invented: str | None = None, share: float = 0.0
) -> tuple[str, list[dict[str, str]], str | None]:
    """Conversation `index`: (category, chat turns, the follow-up turn asked after the answer, or
    None), the same for every call. `invented`: a request the target wrote (invent()), asked as
    it is, under the template's default system message; `share`: the share of conversations that
    are invented, so that the template ones still take the kinds in turn."""
    from .features import held_out

    rng = random.Random(f"{seed}:{index}")
    if invented is not None:
        follow = rng.choice(FOLLOW_UPS) if rng.random() < FOLLOW_SHARE else None
        return "invented", [{"role": "user", "content": invented}], follow
    makers = []
    if pools.functions:
        makers += ["code", "explain", "multi-turn"]
    if pools.modules:
        makers += ["question"]
    if pools.paragraphs:
        makers += ["summarise", "translate", "passage"]
    makers += ["math"]
    slot = index - int(index * share)  # the template conversations before it (is_invented spreads the rest)
    category = makers[slot % len(makers)]
    held = held_out(index)

    def phrase(kind: str, **values) -> str:
        wordings = PHRASES[kind]
        return (wordings[-1] if held else rng.choice(wordings[:-1])).format(**values)

    def text() -> str:  # a paragraph, or a passage of a few
        return rng.choice(pools.passages) if pools.passages and rng.random() < 0.5 else rng.choice(pools.paragraphs)

    if category == "math":
        turns = [{"role": "user", "content": _math(rng)}]
    elif category == "question":
        module, line = rng.choice(pools.modules)
        turns = [{"role": "user", "content": phrase("question", module=module, line=line)}]
    elif category in ("summarise", "translate", "passage"):
        values = {"text": text(), "language": rng.choice(LANGUAGES), "ask": rng.choice(ASKS)}
        turns = [{"role": "user", "content": phrase(category, **values)}]
    else:
        module, signature, summary, source = rng.choice(pools.functions)
        if category in ("code", "explain"):
            content = phrase(category, signature=signature, summary=summary, source=source)
            turns = [{"role": "user", "content": content}]
        else:
            first = f"Show me how `{signature.split('(')[0]}` in Python's `{module}` is written."
            turns = [
                {"role": "user", "content": first},
                {"role": "assistant", "content": f"```python\n{source}\n```"},
                {"role": "user", "content": rng.choice(("Explain how it works.", "How would you test it?"))},
            ]
    if rng.random() < SYSTEM_SHARE:
        turns = [{"role": "system", "content": rng.choice(SYSTEMS)}, *turns]
    follow = rng.choice(FOLLOW_UPS) if rng.random() < FOLLOW_SHARE else None
    return category, turns, follow


# a request's roles: the server's for OpenAI chat (developer is a system turn), and ShareGPT's
# "from" (human, gpt) as the same
ROLES = {**CHAT_ROLES, "human": "user", "gpt": "assistant"}


@dataclass(frozen=True)
class RequestFile:
    """Requests to answer instead of the templates' (`specdec train --requests FILE`), as read_requests
    found them: each chat's (role, text) turns, ending with the user's turn the target answers."""

    path: Path
    chats: tuple[tuple[tuple[str, str], ...], ...]
    categories: tuple[str, ...]  # each request's "category" where it names one, else "requests"
    sha256: str  # of the file's bytes: the data set's name in the features cache
    skipped: int  # entries with no user turn to answer (or an empty one)

    def request(self, index: int) -> tuple[str, list[dict[str, str]], None]:
        """As request(): (category, chat turns, no follow-up: a real request's turns are its own)."""
        return self.categories[index], [{"role": r, "content": c} for r, c in self.chats[index]], None


def read_requests(path: str | Path) -> RequestFile:
    """A JSON Lines file (or one JSON list) of requests, each an OpenAI chat body ({"messages":
    [{"role", "content"}, ...]}, so a server's logged requests serve as they are), a ShareGPT
    conversation ({"conversations": [{"from", "value"}, ...]}, the data EAGLE and Medusa train on)
    or {"prompt": text} (one user turn). Trailing assistant turns are dropped: the target writes
    its own answer to the last user turn, the earlier turns being context as written. An entry
    with no user turn left, or an empty one, is skipped and counted; anything malformed is a
    SpecdecError naming its line, before any answering starts."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecdecError(f"cannot read --requests {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecdecError(f"--requests {path} is not UTF-8 text") from None
    entries: list[tuple[str, object]] = []
    if text.lstrip().startswith("["):  # one JSON list (ShareGPT's files are)
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecdecError(f"--requests {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
        entries = [(f"item {i + 1}", item) for i, item in enumerate(items)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise SpecdecError(f"--requests {path}, line {n}: not JSON ({exc.msg})") from None
    chats, categories, skipped = [], [], 0
    for where, item in entries:
        turns = _chat(item, f"--requests {path}, {where}")
        if turns is None:
            skipped += 1
            continue
        chats.append(turns)
        category = item.get("category") if isinstance(item, dict) else None
        categories.append(category if isinstance(category, str) and category else "requests")
    if not chats:
        raise SpecdecError(f"--requests {path} holds no request with a user turn to answer")
    return RequestFile(path, tuple(chats), tuple(categories), hashlib.sha256(raw).hexdigest(), skipped)


def _chat(item, where: str) -> tuple[tuple[str, str], ...] | None:
    """One entry's (role, text) turns up to its last user turn; None where it has none to answer."""
    if not isinstance(item, dict):
        raise SpecdecError(f"{where}: a request is a JSON object, not {type(item).__name__}")
    if "messages" in item:
        name, role_key, text_key = "messages", "role", "content"
    elif "conversations" in item:
        name, role_key, text_key = "conversations", "from", "value"
    elif "prompt" in item:
        name, role_key, text_key = "prompt", "role", "content"
    else:
        raise SpecdecError(f"{where}: a request needs 'messages' (OpenAI chat), 'conversations' (ShareGPT) or 'prompt'")
    if name == "prompt" and not isinstance(item["prompt"], str):
        raise SpecdecError(f"{where}: 'prompt' must be a string")
    turns = [{"role": "user", "content": item["prompt"]}] if name == "prompt" else item[name]
    if not isinstance(turns, list):
        raise SpecdecError(f"{where}: '{name}' must be a list of turns")
    out = []
    for turn in turns:
        content = turn.get(text_key) if isinstance(turn, dict) else None
        if isinstance(content, list):  # OpenAI's content parts: the text ones, in order
            parts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            content = "".join(part for part in parts if isinstance(part, str)) if parts else None
        if not isinstance(content, str):
            raise SpecdecError(f"{where}: each turn needs its text as a string in '{text_key}'")
        role = ROLES.get(turn.get(role_key))
        if role is None:
            raise SpecdecError(
                f"{where}: unknown role {turn.get(role_key)!r} ({', '.join(CHAT_ROLES)}; ShareGPT's human or gpt)"
            )
        out.append((role, content))
    while out and out[-1][0] == "assistant":
        out.pop()
    if not out or out[-1][0] != "user" or not out[-1][1].strip():
        return None
    return tuple(out)


@dataclass(frozen=True)
class SelfCorpus:
    """Conversations over `files` (the requests' sources), up to `max_tokens` tokens of features."""

    files: list[Path]
    max_tokens: int
    seed: int = 0
    invented: float = 0.0  # the share of conversations whose request the target writes (invent())
    requests: RequestFile | None = None  # the user's own requests, asked instead of the templates'

    def __post_init__(self):
        if self.invented and self.requests is not None:
            raise SpecdecError("--invented is a share of the templates' requests; with --requests there are none")

    @property
    def key(self) -> str:
        if self.requests is not None:  # the file's bytes name the data set; no template or source enters
            text = f"requests {self.requests.sha256} answers {ANSWER_TOKENS} prompts {PROMPT_TOKENS}"
            return hashlib.sha256(text.encode()).hexdigest()
        text = f"{VERSION} answers {ANSWER_TOKENS} prompts {PROMPT_TOKENS} seed {self.seed}"
        if self.invented:
            text += f" invented {self.invented} by {INVENT_SAMPLING} in {INVENT_TOKENS}"
        digest = hashlib.sha256(text.encode())
        for path in self.files:
            digest.update(f"{path}\0{path.stat().st_size}\0".encode())
        return digest.hexdigest()

    def provenance(self, categories: Counter) -> dict:
        if self.requests is not None:
            r = self.requests
            return {
                "kind": f"self: the requests of {r.path.name} ({len(r.chats)} with a user turn to answer, "
                f"{r.skipped} without; sha256 {r.sha256[:16]}), each asked once in the file's order up to its "
                "last user turn, answered by the target (greedy, its chat template, at most "
                f"{ANSWER_TOKENS} tokens an answer; a request over {PROMPT_TOKENS} tokens skipped)",
                "categories": dict(sorted(categories.items())),
                "key": self.key[:16],
            }
        return {
            "kind": "self: chat requests from templates over the sources (4 wordings a kind, the last kept for the "
            f"held-out ones; {SYSTEM_SHARE:.0%} with a system message, {FOLLOW_SHARE:.0%} with a follow-up turn on "
            f"the answer), answered by the target (greedy, its chat template, at most {ANSWER_TOKENS} tokens "
            "an answer)",
            **(
                {
                    "invented": f"{self.invented:.0%} of the conversations ask a request the target wrote itself "
                    f"from its chat template's open user turn (Magpie), sampled at {INVENT_SAMPLING.temperature} "
                    f"with top-p {INVENT_SAMPLING.top_p}; one that did not end its turn within {INVENT_TOKENS} "
                    "tokens, or ended empty, gave way to a template request (categories: 'invented' counts the rest)"
                }
                if self.invented
                else {}
            ),
            "files": len(self.files),
            "categories": dict(sorted(categories.items())),
            "seed": self.seed,
            "key": self.key[:16],
        }


@dataclass
class _Answer:
    index: int
    category: str
    fed: list[int]  # prompt, then the answer's tokens as they are fed back
    labels: list[int]  # the target's greedy token after each fed token
    hidden: list[np.ndarray]
    prompt: int  # tokens of it that are the request
    turns: list[dict[str, str]]
    follow: str | None  # the follow-up turn still to ask
    start: int  # where the answer under way starts in `fed`
    asked: list[tuple[int, int]]  # the spans of `fed` that are requests (the follow-up's too)

    def add(self, tokens, logits: np.ndarray, hidden: np.ndarray) -> None:
        self.fed += [int(t) for t in tokens]
        self.labels += logits.argmax(-1).tolist()
        self.hidden.append(hidden)


def _write(path: Path, a: _Answer) -> None:
    buf = io.BytesIO()
    np.savez(
        buf,
        tokens=np.asarray(a.fed, np.int32),
        labels=np.asarray(a.labels, np.int32),
        hidden=np.concatenate(a.hidden).astype(np.float16),
        prompt=np.int32(a.prompt),
        asked=np.asarray(a.asked, np.int32).reshape(-1, 2),
    )
    write_atomically(path, buf.getvalue())


MARK = "\ue000here\ue001"  # stands in one message's content, to cut the rendered template there


def _template_around_mark(tokenizer, messages: list[dict[str, str]]) -> tuple[str, str]:
    """The chat template rendered over `messages`, one of whose contents is MARK: the text before
    and after it (a turn's opening and closing, as the template writes them)."""
    text = tokenizer.apply_chat_template(messages)
    at = text.index(MARK)
    return text[:at], text[at + len(MARK) :]


def follow_up_tokens(target, turns: list[dict[str, str]], follow: str) -> list[int]:
    """What comes after an answer to ask `follow`: the chat template's end of the assistant's turn,
    the user's turn and the opening of the next answer (a base model: the text between blank lines)."""
    tokenizer = target.tokenizer
    if not target.is_instruct:
        return tokenizer.encode(f"\n\n{follow}\n\n", add_special=False, special=False)
    _, after = _template_around_mark(
        tokenizer, [*turns, {"role": "assistant", "content": MARK}, {"role": "user", "content": follow}]
    )
    return tokenizer.encode(after, add_special=False, special=True)


def is_invented(index: int, share: float) -> bool:
    """Whether conversation `index` asks a request the target invents: `share` of them, evenly spread."""
    return share > 0 and int((index + 1) * share) > int(index * share)


def invent(target, indices: list[int], seed: int = 0) -> dict[int, str | None]:
    """Requests the target writes itself, one a row at once (Magpie, Xu et al. 2024: an aligned
    model given its chat template up to an open user turn writes what users ask it). Each index
    samples with its own seeded generator; a request that does not end its turn within
    INVENT_TOKENS tokens, or ends empty, is None."""
    tokenizer = target.tokenizer
    before, _ = _template_around_mark(tokenizer, [{"role": "user", "content": MARK}])
    opening = tokenizer.encode(before, add_special=False, special=True)
    rows = target.add_rows(len(indices))
    index_of = dict(zip(rows, indices))
    rngs = {row: np.random.default_rng([seed, index]) for row, index in index_of.items()}
    written: dict[int, list[int]] = {row: [] for row in rows}
    ended: set[int] = set()
    try:
        logits = target.forward_rows({row: opening for row in rows}, {row: 1 for row in rows})
        live = list(rows)
        for _ in range(INVENT_TOKENS):
            fed = {}
            for row in live:
                token = sample(logits_to_probs(logits[row][-1], INVENT_SAMPLING), rngs[row])
                if token in tokenizer.eog_ids:
                    ended.add(row)
                else:
                    written[row].append(token)
                    fed[row] = [token]
            live = list(fed)
            if not live:
                break
            logits = target.forward_rows(fed, {row: 1 for row in live})
    finally:
        target.drop_rows(rows)
    out = {}
    for row, index in index_of.items():
        request = tokenizer.decode(written[row]).strip() if row in ended else ""
        out[index] = request or None
    return out


def _invented_requests(
    target, folder: Path, share: float, seed: int, upto: int, rows: int, have: dict, progress: bool = False
) -> None:
    """Fill `have` (index -> request or None) for the invented conversations below `upto`,
    `rows` at a time, saving the file after each block so that an interrupted run keeps them."""
    wanted = [i for i in range(upto) if is_invented(i, share) and i not in have]
    bar = Progress("requests", len(wanted), "req", progress and bool(wanted))  # (closing writes only if shown)
    try:
        for start in range(0, len(wanted), rows):
            have.update(invent(target, wanted[start : start + rows], seed))
            write_atomically(folder / INVENTED, json.dumps({str(i): q for i, q in sorted(have.items())}).encode())
            bar.update(min(start + rows, len(wanted)))
    finally:
        bar.close()


def collect(target, corpus: SelfCorpus, progress: bool = True, rows: int = ROWS) -> Path:
    """Have the target answer the corpus's requests, `rows` at a time, keeping features as it
    goes; the folder. Conversations already on disk are not asked again. The answers are greedy, so
    `rows` changes how fast they come, not what they are (up to the backend's rounding ties)."""
    from ..request import tokens as prompt_tokens

    if target.n_ctx < N_CTX:
        raise SpecdecError(f"answering needs a context of {N_CTX} tokens a row; the target has {target.n_ctx}")
    if corpus.invented and not target.is_instruct:
        raise SpecdecError("invented requests need a chat model: a base model has no user turn to open")
    folder = features_folder(target, corpus)
    folder.mkdir(parents=True, exist_ok=True)
    rows = min(rows, target.max_rows)
    supply = len(corpus.requests.chats) if corpus.requests is not None else None  # None: the templates never end
    pools = read_pools(corpus.files, corpus.seed) if supply is None else Pools()
    invented: dict[int, str | None] = {}
    if corpus.invented:
        if (folder / INVENTED).exists():
            invented = {int(i): q for i, q in json.loads((folder / INVENTED).read_text(encoding="utf-8")).items()}
        # the conversations the budget will likely reach (~400 tokens each: 300 errs long), all rows at once
        upto = corpus.max_tokens // 300 + 1
        _invented_requests(target, folder, corpus.invented, corpus.seed, upto, rows, invented, progress)
    target.keep_hidden()
    eog = target.tokenizer.eog_ids
    bar = Progress("answers", corpus.max_tokens, "tok", progress)
    live: dict[int, _Answer] = {}
    categories: Counter = Counter()
    done = index = windows = skipped = 0
    after = 0  # tokens past the request in the finished conversations (answers, follow-ups)

    def under_way() -> float:
        """What the conversations under way will likely come to, each at least as far as it got:
        until a batch of them has finished (the short ones finish first), the most its answers can
        be; then its request and the answers the finished ones average. So a small budget does not
        take a whole batch of rows that then overshoot it together."""

        def likely(a: _Answer) -> float:
            if windows >= rows:
                return a.prompt + after / windows
            return a.prompt + ANSWER_TOKENS + (FOLLOW_TOKENS + ANSWER_TOKENS if a.follow else 0)

        return sum(max(len(a.fed), likely(a)) for a in live.values())

    try:
        while True:
            # take requests while the budget lasts
            while len(live) < rows and done + under_way() < corpus.max_tokens and (supply is None or index < supply):
                if is_invented(index, corpus.invented) and index not in invented:  # past the estimate
                    free = rows - len(live)
                    _invented_requests(target, folder, corpus.invented, corpus.seed, index + free, free, invented)
                if corpus.requests is not None:
                    category, turns, follow = corpus.requests.request(index)
                else:
                    category, turns, follow = request(index, pools, corpus.seed, invented.get(index), corpus.invented)
                path = folder / f"window-{index:06d}.npz"
                index += 1
                if path.exists():
                    with np.load(path) as part:
                        done += len(part["tokens"])
                        after += len(part["tokens"]) - int(part["prompt"])
                    categories[category] += 1
                    windows += 1
                    continue
                try:  # a base model reads the turns as plain text
                    ids = (
                        prompt_tokens(target, messages=turns)
                        if target.is_instruct
                        else prompt_tokens(target, "\n\n".join(t["content"] for t in turns), chat=False)
                    )
                except PromptError:
                    ids = []
                if not 0 < len(ids) <= PROMPT_TOKENS:
                    skipped += 1
                    if skipped > MAX_SKIPPED:
                        raise SpecdecError(f"{skipped} requests in a row were longer than {PROMPT_TOKENS} tokens")
                    continue
                skipped = 0
                row = target.add_rows(1)[0]
                a = _Answer(index - 1, category, [], [], [], len(ids), turns, follow, len(ids), [(0, len(ids))])
                a.add(ids, target.forward_rows({row: ids}, {row: len(ids)})[row], target.hidden_rows([row])[row][1])
                live[row] = a
            ended = [
                row
                for row, a in live.items()
                if a.labels[-1] in eog or len(a.fed) - a.start + 1 >= ANSWER_TOKENS or len(a.fed) >= target.n_ctx
            ]
            for row in list(ended):  # a second turn about the answer, where one is asked and fits
                a = live[row]
                suffix = follow_up_tokens(target, a.turns, a.follow) if a.follow else []
                if suffix and len(a.fed) + len(suffix) + ANSWER_TOKENS <= target.n_ctx:
                    a.asked.append((len(a.fed), len(a.fed) + len(suffix)))
                    logits = target.forward_rows({row: suffix}, {row: len(suffix)})[row]
                    a.add(suffix, logits, target.hidden_rows([row])[row][1])
                    a.follow, a.start = None, len(a.fed)
                    ended.remove(row)
            for row in ended:
                a = live.pop(row)
                _write(folder / f"window-{a.index:06d}.npz", a)
                done += len(a.fed)
                after += len(a.fed) - a.prompt
                categories[a.category] += 1
                windows += 1
            if ended:
                target.drop_rows(ended)
            if not live:
                if ended:  # room again: the next requests
                    continue
                break
            fed = {row: [a.labels[-1]] for row, a in live.items()}
            logits = target.forward_rows(fed, {row: 1 for row in live})
            states = target.hidden_rows(live)
            for row, a in live.items():
                a.add(fed[row], logits[row], states[row][1])
            bar.update(done + sum(len(a.fed) for a in live.values()))
    finally:
        if live:
            target.drop_rows(list(live))
        bar.update(done, force=True)
        bar.close()
    write_atomically(
        folder / "data.json",
        json.dumps({"tokens": done, "windows": windows, **corpus.provenance(categories)}, indent=1).encode(),
    )
    return folder
