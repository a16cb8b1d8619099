"""A head file: a trained head's weights (safetensors) and what it is (JSON in the file's metadata).

One file, readable without torch (safetensors' NumPy API). Its metadata says the head's kind and
shape, the target it was trained on (the GGUF's sha256: a head drafts from that model's hidden
states and nothing else's), the draft vocabulary, where the training text came from, how many
tokens and seconds training took, and the held-out agreement it reached.

Tensors (d: the target's hidden width, V: the draft vocabulary's size):
    vocab    [V] int32       target token ids the head can draft (most frequent in training first)
    lm_head  [V, d] float16  the target's own output head, those rows (frozen in training)
    medusa:  medusa.{i}.weight [d, d], medusa.{i}.bias [d]     for i in 0 .. n_heads - 1
    prophet: embed [V + 1, d] (the last row: any token outside the vocabulary), fuse.weight [d, 2d],
             step [n_steps, d], attn_norm [d], wq wk wv wo [d, d], ffn_norm [d], w_gate w_up [f, d],
             w_down [d, f]
    early-exit (L layers + B blocks): blk.{L + j}.{name} for j in 0 .. B - 1, the blocks' tensors under
             the target's own GGUF names (attn_norm.weight, attn_q.weight, ...); no vocab or lm_head:
             the draft model it becomes (drafters.early_exit.exit_model_path) has the target's whole head
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import SpecdecError
from ..paths import reason, write_atomically

FORMAT = "specdec-head/1"
KINDS = ("medusa", "prophet", "early-exit")


@dataclass(frozen=True)
class HeadInfo:
    kind: str  # "medusa", "prophet" or "early-exit"
    target_sha256: str  # the GGUF the head drafts for
    target_name: str
    n_embd: int
    vocab_size: int  # the target's
    steps: int  # medusa: heads (draft tokens a step at most); prophet: the chain it was trained on;
    # early-exit: the chain its held-out estimate counts (it drafts as a draft model, any length)
    n_head: int = 0  # prophet: attention heads
    n_ff: int = 0  # prophet: MLP width
    layers: int = 0  # early-exit: the target's first layers the draft runs
    blocks: int = 0  # early-exit: trained blocks after them
    data: dict = field(default_factory=dict)  # provenance: sources, files, bytes, tokens
    training: dict = field(default_factory=dict)  # tokens, steps, seconds, learning rate
    held_out: dict = field(default_factory=dict)  # agreement with the target by position

    def describe(self) -> str:
        agree = self.held_out.get("agreement")
        shown = ", ".join(f"{a:.2f}" for a in agree) if agree else "not measured"
        shape = f"{self.layers} layers + {self.blocks} trained" if self.kind == "early-exit" else f"{self.steps} steps"
        return f"{self.kind} head ({shape}) for {self.target_name}; held-out agreement by position: {shown}"


def save(path: str | os.PathLike, info: HeadInfo, tensors: dict[str, np.ndarray]) -> None:
    """Write the head whole or not at all."""
    from safetensors.numpy import save as to_bytes

    if info.kind not in KINDS:
        raise ValueError(f"unknown head kind {info.kind!r}")
    tensors = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    write_atomically(path, to_bytes(tensors, metadata={"format": FORMAT, "specdec": json.dumps(asdict(info))}))


def read_info(path: str | os.PathLike) -> HeadInfo:
    """A head file's info alone (its header: no weights read), or the error `load` would give."""
    return load(path, tensors=False)[0]


def load(path: str | os.PathLike, tensors: bool = True) -> tuple[HeadInfo, dict[str, np.ndarray]]:
    """(info, float32 weights and the int32 vocab) of a head file; a clear error for anything else."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise SpecdecError("reading a head file needs safetensors: pip install safetensors") from exc
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"head file not found: {path} (make one with `specdec train`)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise SpecdecError(f"{path} is not a specdec head file (make one with `specdec train`)")
            info = HeadInfo(**json.loads(meta["specdec"]))
            arrays = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
    except SpecdecError:
        raise
    except OSError as exc:
        raise SpecdecError(f"cannot read head file {path}: {reason(exc)}") from None
    except Exception as exc:  # safetensors' own errors for a damaged file, or metadata of another shape
        raise SpecdecError(f"{path} is not a readable head file ({exc}); train it again") from None
    weights = {name: a if a.dtype == np.int32 else a.astype(np.float32) for name, a in arrays.items()}
    return info, weights


def check_target(info: HeadInfo, target, path) -> None:
    """A head drafts from its own target's hidden states only: refuse any other model in one line."""
    if info.target_sha256 != target.identity:
        raise SpecdecError(
            f"head {Path(path).name} was trained for {info.target_name} (sha256 {info.target_sha256[:12]}…), "
            f"not {target.name} (sha256 {target.identity[:12]}…): train one for this model with `specdec train`"
        )
