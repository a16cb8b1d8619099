"""Early exit with trained head blocks (`specdec train early-exit:L+B`).

The draft is the target's first L layers, then B transformer blocks of the target's own shape
trained to make the target's next token, then the target's final norm and output head (seed 004's
extra head block; Kangaroo, Liu et al. 2404.18911, trains an adapter on an early exit the same
way). The B blocks start as the target's layers L .. L + B - 1, so before training the draft is the
target cut after L + B layers; training moves them so that what comes out after them is what the
target says after all of its layers.

What is learned from: the cached features of train.features (windows of text, each token with the
target's greedy next token as its label), and, per window, the residual stream after layer L,
computed here once in torch from the target's own weights (read and dequantised by the NumPy
backend's loader) and cached beside the features (float16, 2 bytes x the width a token).

The head file holds the B blocks' tensors under their GGUF names (blk.L.attn_q.weight, ...):
drafters.early_exit.exit_model_path writes them with the target's first L layers into a GGUF that
drafts as an ordinary draft model of the target's vocabulary. Its cache is its own (llama.cpp's
C API runs a model's layers whole: it has no call that stops a forward after layer L and shares
that layer's cache), so the draft recomputes its L layers for the tokens it catches up on.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..drafters import headfile
from ..errors import SpecdecError
from ..models.numpy_ref import as_float32, matmul
from ..paths import write_atomically
from . import EXIT_EPOCHS, EXIT_LR, EXIT_WINDOWS  # noqa: F401 (here for the trainer's callers)
from .features import Features, Progress, held_out

F16_MAX = 60_000.0
EVAL_TOKENS = 256  # held-out positions scored against the whole output head at a time


@functools.cache
def _block_class():
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        """One transformer block of the target's architecture, in torch: the math of
        models.numpy_ref.NumpyModel.block over one window (causal, positions 0 ..), with its
        weights as parameters named by their GGUF names ('.' written '/')."""

        def __init__(self, config, weights: dict[str, np.ndarray], trainable: bool):
            super().__init__()
            self.config = config
            self.w = nn.ParameterDict(
                {
                    name.replace(".", "/"): nn.Parameter(
                        torch.from_numpy(as_float32(a).copy()), requires_grad=trainable
                    )
                    for name, a in weights.items()
                }
            )

        def tensors(self) -> dict:
            return {name.replace("/", "."): p for name, p in self.w.items()}

        def _get(self, name: str):
            return self.w[name.replace(".", "/")] if name.replace(".", "/") in self.w else None

        def norm(self, x, name: str):
            return norm(self.config, x, self._get(f"{name}.weight"), self._get(f"{name}.bias"))

        def linear(self, x, name: str):
            y = x @ self._get(f"{name}.weight").T
            bias = self._get(f"{name}.bias")
            return y if bias is None else y + bias

        def forward(self, x):
            """x [T, d] (one window, positions 0 .. T - 1) -> [T, d]."""
            c = self.config
            T = x.shape[0]
            h = self.norm(x, "attn_norm")
            if self._get("attn_qkv.weight") is not None:
                q, k, v = self.linear(h, "attn_qkv").chunk(3, -1)
            else:
                q, k, v = self.linear(h, "attn_q"), self.linear(h, "attn_k"), self.linear(h, "attn_v")
            q = q.view(T, c.n_head, c.head_dim)
            k = k.view(T, c.n_head_kv, c.head_dim)
            v = v.view(T, c.n_head_kv, c.head_dim)
            if c.positions.startswith("rope"):
                q, k = (rope(t, c.rope_base, c.positions == "rope-neox") for t in (q, k))
            group = c.n_head // c.n_head_kv  # query head h reads kv head h // group
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            x = x + self.linear(a.transpose(0, 1).reshape(T, c.n_head * c.head_dim), "attn_output")
            h = self.norm(x, "ffn_norm")
            if c.mlp == "swiglu":
                h = F.silu(self.linear(h, "ffn_gate")) * self.linear(h, "ffn_up")
            else:
                h = F.gelu(self.linear(h, "ffn_up"), approximate="tanh")
            return x + self.linear(h, "ffn_down")

    return Block


def norm(config, x, weight, bias=None):
    """The target's norm (RMS or layer norm) in torch, as models.numpy_ref computes it."""
    import torch
    from torch.nn import functional as F

    if config.norm == "rms":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.norm_eps) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, bias, config.norm_eps)


def rope(x, base: float, neox: bool):
    """models.numpy_ref.rope in torch, at positions 0 .. T - 1: x [T, heads, head_dim]."""
    import torch

    T, half = x.shape[0], x.shape[-1] // 2
    inv_freq = base ** (-np.arange(half) / half)
    angle = np.arange(T)[:, None] * inv_freq[None, :]
    cos = torch.from_numpy(np.cos(angle).astype(np.float32))[:, None, :]
    sin = torch.from_numpy(np.sin(angle).astype(np.float32))[:, None, :]
    if neox:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


def block(model, i: int, trainable: bool = False):
    """The NumPy model's layer i as a torch Block (float32 weights)."""
    return _block_class()(model.config, model.layers[i], trainable)


def _embed(model, tokens: np.ndarray):
    import torch

    x = model.embed(np.asarray(tokens, np.int64), 0)
    return torch.from_numpy(np.ascontiguousarray(x, np.float32))


def exit_states(model, f: Features, layers: int, folder: Path, progress: bool = True) -> np.ndarray:
    """[N, d] float16 (float32 where a value passes float16's range): the residual stream after the
    first `layers` layers at every feature token,
    window by window from position 0 (as the features were taken), cached in `folder`
    (one file a window, written whole; an interrupted run resumes)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    blocks = None
    parts = []
    bar = Progress(f"layer {layers} states", int(f.starts[-1]), "tok", progress)
    try:
        for w, (a, b) in enumerate(zip(f.starts[:-1], f.starts[1:])):
            path = folder / f"window-{int(f.index[w]):06d}.npy"
            if path.exists():
                part = np.load(path)
            else:
                if blocks is None:
                    blocks = [block(model, i) for i in range(layers)]
                with torch.no_grad():
                    x = _embed(model, f.tokens[a:b])
                    for layer in blocks:
                        x = layer(x)
                part = x.numpy()
                if np.abs(part).max() < F16_MAX:  # (a model's outlier features may not fit float16)
                    part = part.astype(np.float16)
                buf = io.BytesIO()
                np.save(buf, part)
                write_atomically(path, buf.getvalue())
            parts.append(part)
            bar.update(int(b))
    finally:
        bar.update(int(f.starts[len(parts)]), force=True)
        bar.close()
    return np.concatenate(parts)


class ExitHead:
    """The trained part of the draft: B blocks, then the target's final norm and the draft
    vocabulary's rows of its output head (both frozen)."""

    def __init__(self, model, layers: int, n_blocks: int, vocab: np.ndarray):
        import torch
        from torch import nn

        self.layers, self.n_blocks = layers, n_blocks
        self.config = model.config
        self.blocks = nn.ModuleList(block(model, layers + j, trainable=True) for j in range(n_blocks))
        self.norm_weight, self.norm_bias = (
            torch.from_numpy(model.weights[name]) if name in model.weights else None
            for name in ("output_norm.weight", "output_norm.bias")
        )
        self.lm_head = torch.from_numpy(np.ascontiguousarray(model.head_weights("output", vocab)))

    def features(self, x):
        """States after layer L [T, d] -> the final norm's output after the blocks [T, d]."""
        for layer in self.blocks:
            x = layer(x)
        return norm(self.config, x, self.norm_weight, self.norm_bias)

    def parameters(self):
        return self.blocks.parameters()

    def file_tensors(self) -> dict[str, np.ndarray]:
        """The blocks under their GGUF names, layer numbers as in the draft model (L ..)."""
        out = {}
        for j, layer in enumerate(self.blocks):
            for name, p in layer.tensors().items():
                out[f"blk.{self.layers + j}.{name}"] = p.detach().numpy().astype(np.float16)
        return out


def train_exit(
    target, model, f: Features, config, states: np.ndarray, out: Path, data: dict, progress: bool = True
) -> headfile.HeadInfo:
    """Train the blocks on (states after layer L -> the target's greedy token), whole windows at a
    time; write the head file `out`. Ctrl-C leaves `out`.ckpt, which the same call resumes."""
    import torch
    from torch.nn import functional as F

    from .trainer import checkpoint_path, draft_vocabulary, run_updates

    torch.manual_seed(config.seed)
    held = np.array([held_out(i) for i in f.index], dtype=bool)
    train_windows = [w for w in range(f.n_windows) if not held[w]]
    if not train_windows:
        raise SpecdecError("not enough training text for one window: give more with --data or --tokens")
    training = np.concatenate([np.arange(f.starts[w], f.starts[w + 1]) for w in train_windows])
    vocab = draft_vocabulary(f.labels[training], config.vocab, target.vocab_size)
    index = np.full(target.vocab_size, -100, np.int64)  # outside the draft vocabulary: not learned
    index[vocab] = np.arange(len(vocab))
    head = ExitHead(model, config.layers, config.blocks, vocab)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0)
    per_update = min(config.batch, len(train_windows))
    total = max(1, math.ceil(config.epochs * len(train_windows) / per_update))

    def step(rng) -> str:
        picked = rng.choice(train_windows, size=per_update, replace=False)
        n = sum(int(f.starts[w + 1] - f.starts[w]) for w in picked)
        loss_sum, agree, counted = 0.0, 0, 0
        for w in picked:  # one window a forward (whole: its attention spans it), gradients summed
            a, b = f.starts[w], f.starts[w + 1]
            labels = torch.from_numpy(index[f.labels[a:b]])
            logits = head.features(torch.from_numpy(states[a:b].astype(np.float32))) @ head.lm_head.T
            loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / n
            loss.backward()
            loss_sum += loss.item()
            valid = labels != -100
            agree += int(((logits.argmax(-1) == labels) & valid).sum())
            counted += int(valid.sum())
        return f"loss {loss_sum:.3f} agree@1 {agree / max(counted, 1):.2f}"

    label = f"train early-exit:{config.layers}+{config.blocks}"
    update, seconds = run_updates(head.blocks, optimizer, config, total, out, label, step, progress)
    held_windows = [w for w in range(f.n_windows) if held[w]]
    info = headfile.HeadInfo(
        kind="early-exit",
        target_sha256=target.identity,
        target_name=getattr(target, "description", target.name),
        n_embd=target.n_embd,
        vocab_size=target.vocab_size,
        steps=config.steps,
        layers=config.layers,
        blocks=config.blocks,
        data=data,
        training={
            **asdict(config),
            "tokens": int(len(training)),
            "updates": update,
            "seconds_this_run": round(seconds, 1),
        },
        held_out=evaluate_exit(head, model, f, states, held_windows, config.steps),
    )
    headfile.save(out, info, head.file_tensors())
    checkpoint_path(out).unlink(missing_ok=True)
    return info


def evaluate_exit(head: ExitHead, model, f: Features, states: np.ndarray, windows: list[int], steps: int) -> dict:
    """Held-out agreement with the target's greedy token, the draft's choice taken over the WHOLE
    output head (as the draft model chooses), and the chain's: after an agreed guess the draft's
    context is the true one (the text is the target's own greedy answer), so a chain of i + 1 is
    kept where i + 1 agreements in a row start (teacher forced, as the heads' estimate)."""
    import torch

    if not windows:
        return {}
    rows = []
    with torch.no_grad():
        for w in windows:
            a, b = int(f.starts[w]), int(f.starts[w + 1])
            h = head.features(torch.from_numpy(states[a:b].astype(np.float32))).numpy()
            choice = np.concatenate(  # (matmul takes float32 or bfloat16 weights)
                [
                    matmul(h[i : i + EVAL_TOKENS], model.weights["output.weight"]).argmax(-1)
                    for i in range(0, b - a, EVAL_TOKENS)
                ]
            )
            rows.append(choice == f.labels[a:b])
    return chain_summary(rows, steps)


def chain_summary(agree_by_window: list[np.ndarray], steps: int) -> dict:
    """{positions, agreement by chain position, chain, tokens_per_step} from per-token agreement,
    window by window (a chain does not run past its window's end)."""
    chains = np.zeros(steps)
    positions = 0
    for agree in agree_by_window:
        n = len(agree) - steps + 1
        if n <= 0:
            continue
        run = np.ones(n, dtype=bool)
        for i in range(steps):
            run &= agree[i : i + n]
            chains[i] += run.sum()
        positions += n
    if positions == 0:
        return {}
    first = float(np.concatenate(agree_by_window).mean())
    chain = chains / positions
    return {
        "positions": positions,
        "agreement": [round(first, 4)] + [round(float(chain[i] / max(chain[i - 1], 1e-9)), 4) for i in range(1, steps)],
        "chain": [round(float(c), 4) for c in chain],
        "tokens_per_step": round(1.0 + float(chain.sum()), 3),
    }
