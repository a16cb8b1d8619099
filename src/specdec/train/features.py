"""Training data for a head: text the machine already has, run once through the target.

For every window of training text the target gives, per token: its id, its hidden state after the
final norm (float16) and its own greedy next token (the label a head learns: what the target would
say, not what the text says; teacher forcing over the text, as Medusa and EAGLE train). Windows are
written one file each, whole or not at all, into a folder named by the target and the data, so an
interrupted run resumes where it stopped and a second training run on the same data computes
nothing again.

The default text is what ships with this Python: the standard library's sources and the Markdown
and reStructuredText documentation of the installed packages. Never our evaluation prompts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SpecdecError
from ..paths import specdec_home, write_atomically
from ..progress import Progress  # noqa: F401 (the trainer's callers import it here)

WINDOW = 512  # tokens per forward (and per feature file): one llama.cpp batch
MIN_WINDOW = 32  # shorter windows are skipped
# every HELD_OUT_EVERY-th window (a whole file's: one window a file) is held out of training, for the
# held-out agreement; the same windows whatever the token budget, so a learning curve compares alike
HELD_OUT_EVERY = 20
# one window a file, from a seeded place in it: a long file (a codec table in the standard library
# is 16 000 tokens of hex) must not fill the budget, and many files teach more than a few
MIN_DISTINCT = 0.2  # a window of fewer distinct tokens per token is a data table, not text: skipped
DOC_SUFFIXES = (".md", ".rst")
MAX_FILE_BYTES = 200_000  # a longer file contributes its first part only


def default_sources() -> list[Path]:
    """The standard library's .py files and the installed packages' Markdown/reST documentation."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    code = [p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts]
    docs = [p for p in site.rglob("*") if p.suffix in DOC_SUFFIXES and p.is_file()]
    return sorted(code) + sorted(docs)


def expand(paths: list[str]) -> list[Path]:
    """--data: files, or folders (their .py .md .rst .txt files, recursively)."""
    files = []
    for text in paths:
        path = Path(text).expanduser()
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md", ".rst", ".txt") and p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise SpecdecError(f"--data {text}: no such file or folder")
    if not files:
        raise SpecdecError(f"--data {' '.join(paths)}: no .py, .md, .rst or .txt files there")
    return files


@dataclass(frozen=True)
class Corpus:
    files: list[Path]
    max_tokens: int
    min_distinct: float = MIN_DISTINCT  # (a tiny test vocabulary of letters needs 0)

    @property
    def key(self) -> str:
        """Names the data: the files (path and size) and how windows are cut (not the budget: a
        smaller budget's windows are the first of a larger one's)."""
        digest = hashlib.sha256(f"window {WINDOW} one a file, distinct {self.min_distinct}".encode())
        for path in self.files:
            digest.update(f"{path}\0{path.stat().st_size}\0".encode())
        return digest.hexdigest()

    def provenance(self) -> dict:
        roots: dict[str, int] = {}
        for path in self.files:
            root = str(path.parent if len(path.parts) < 4 else Path(*path.parts[:4]))
            roots[root] = roots.get(root, 0) + 1
        return {
            "files": len(self.files),
            "bytes": sum(p.stat().st_size for p in self.files),
            "roots": dict(sorted(roots.items(), key=lambda kv: -kv[1])[:12]),
            "key": self.key[:16],
        }


def windows(corpus: Corpus, tokenizer):
    """(index, tokens) of one window a file, files in a seeded shuffle (code and docs mixed), up
    to the token budget."""
    files = list(corpus.files)
    random.Random(0).shuffle(files)
    total, index = 0, 0
    for path in files:
        try:
            text = path.read_bytes()[:MAX_FILE_BYTES].decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        tokens = tokenizer.encode(text, add_special=False, special=False)
        n = max(1, len(tokens) // WINDOW)
        start = WINDOW * random.Random(str(path)).randrange(n)
        chunk = tokens[start : start + WINDOW][: corpus.max_tokens - total]
        if len(chunk) < MIN_WINDOW or len(set(chunk)) < corpus.min_distinct * len(chunk):
            continue
        yield index, chunk
        index, total = index + 1, total + len(chunk)
        if total >= corpus.max_tokens:
            return


def features_folder(target, corpus: Corpus) -> Path:
    return specdec_home() / "features" / f"{target.identity[:16]}-{corpus.key[:16]}"


def collect(target, corpus: Corpus, progress: bool = True) -> Path:
    """Run the corpus through the target once (skipping windows already on disk); the folder."""
    folder = features_folder(target, corpus)
    folder.mkdir(parents=True, exist_ok=True)
    target.keep_hidden()
    row = target.add_rows(1)[0]
    bar = Progress("features", corpus.max_tokens, "tok", progress)
    done = index = 0
    try:
        for index, tokens in windows(corpus, target.tokenizer):
            path = folder / f"window-{index:06d}.npz"
            if not path.exists():
                target.rollback_rows({row: 0})
                logits = target.forward_rows({row: tokens}, {row: len(tokens)})[row]  # [n, vocab]
                _, hidden = target.hidden_rows([row])[row]  # [n, d]
                buf = io.BytesIO()
                np.savez(
                    buf,
                    tokens=np.asarray(tokens, np.int32),
                    labels=logits.argmax(-1).astype(np.int32),  # the target's greedy next token
                    hidden=hidden.astype(np.float16),
                )
                write_atomically(path, buf.getvalue())
            done += len(tokens)
            bar.update(done)
    finally:
        target.drop_rows([row])
        bar.update(done, force=True)
        bar.close()
    write_atomically(
        folder / "data.json",
        json.dumps({"tokens": done, "windows": index + 1 if done else 0, **corpus.provenance()}, indent=1).encode(),
    )
    return folder


@dataclass
class Features:
    tokens: np.ndarray  # [N] int32, windows one after another
    labels: np.ndarray  # [N] int32: the target's greedy token after each
    hidden: np.ndarray  # [N, d] float16
    starts: np.ndarray  # [n_windows + 1]: window w is rows starts[w] .. starts[w + 1] - 1
    index: np.ndarray  # [n_windows]: each window's index in the corpus

    @property
    def n_windows(self) -> int:
        return len(self.starts) - 1

    def split(self) -> tuple["Features", "Features"]:
        """(training, held-out): every HELD_OUT_EVERY-th window of the corpus is held out."""
        held = np.array([held_out(i) for i in self.index], dtype=bool)
        return self._select(~held), self._select(held)

    def _select(self, keep: np.ndarray) -> "Features":
        rows = np.concatenate(
            [np.arange(a, b) for a, b, k in zip(self.starts[:-1], self.starts[1:], keep) if k] or [[]]
        )
        rows = rows.astype(np.int64)
        lengths = np.diff(self.starts)[keep]
        return Features(
            self.tokens[rows],
            self.labels[rows],
            self.hidden[rows],
            np.concatenate([[0], np.cumsum(lengths)]),
            self.index[keep],
        )


def held_out(index: int) -> bool:
    return index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def load_features(folder: Path, max_tokens: int | None = None) -> Features:
    """The cached windows in corpus order: every held-out one, and the training ones up to
    `max_tokens` training tokens (the first of the corpus), so that budgets share one cache and
    one held-out set."""
    parts, total = [], 0
    for f in sorted(folder.glob("window-*.npz")):
        index = int(f.stem.split("-")[1])
        if not held_out(index) and max_tokens is not None and total >= max_tokens:
            continue
        part = np.load(f)
        parts.append((index, part))
        total += 0 if held_out(index) else len(part["tokens"])
    if not parts:
        raise SpecdecError(f"no training text: the data gave no window of {MIN_WINDOW} tokens or more")
    lengths = [len(p["tokens"]) for _, p in parts]
    return Features(
        np.concatenate([p["tokens"] for _, p in parts]),
        np.concatenate([p["labels"] for _, p in parts]),
        np.concatenate([p["hidden"] for _, p in parts]),
        np.concatenate([[0], np.cumsum(lengths)]),
        np.array([i for i, _ in parts]),
    )


def clear(folder: Path) -> None:
    for f in folder.glob("window-*.npz"):
        os.unlink(f)
