"""Training a head on cached features (train.features), with a resumable checkpoint.

Labels are the target's own greedy tokens (distillation: a head is judged by agreeing with the
target, not with the text). Medusa head i on the hidden state at t learns the target's token at
t + i + 2; the prophet chain, started from the hidden state at t and fed the text's tokens
t + 1, t + 2, ..., learns the target's tokens after each, and, at a small weight, the target's
own next hidden states (EAGLE's feature regression). It is unrolled on its own predicted features,
as it drafts. It trains where the target runs: on the target's GPU when the torch backend has it
on one, else on the CPU.

A checkpoint (the weights, the optimiser, the update count) is written whole every minute and on
Ctrl-C, beside the output file; the same command resumes from it, and it goes once the head file
is written.
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..drafters import headfile
from ..errors import SpecdecError
from ..paths import write_atomically
from .features import Features, Progress

CHECKPOINT_SECONDS = 60.0  # how much work Ctrl-C or a crash can lose


@dataclass(frozen=True)
class TrainConfig:
    kind: str  # "medusa", "prophet" or "early-exit" (train.exit)
    steps: int = 3  # medusa: heads; prophet: the chain trained (and drafted) at most; early-exit: the
    # chain its held-out estimate counts
    vocab: int = 8192  # draft vocabulary: the training data's most frequent tokens, then the target's lowest ids
    epochs: float = 2.0
    batch: int = 128  # chains per update (early-exit: windows)
    lr: float = 1e-3
    n_head: int = 8  # prophet attention heads (must divide the hidden width)
    n_ff: int = 1024  # prophet MLP width
    feature_weight: float = 0.1  # prophet: weight of the feature regression beside the token loss
    seed: int = 0
    layers: int = 0  # early-exit: the target's first layers kept
    blocks: int = 0  # early-exit: trained blocks after them


def device_of(target) -> str:
    """Where a head for `target` trains: the torch backend's device when it is not the CPU (the
    features then come fast, and so do the updates), else the CPU (llama.cpp, NumPy)."""
    device = str(getattr(target, "device", "cpu"))
    return device if device.split(":")[0] in ("cuda", "mps", "xpu") else "cpu"


def draft_vocabulary(labels: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """`size` target ids ([V] int32): the tokens the target predicted in the training data, most
    often first, then the lowest ids it never predicted there. Tens of thousands of training tokens
    hold a few thousand distinct ones, and a token outside the draft vocabulary is never drafted:
    the 20 000-token head's 2 977 covered 43-82% of the dev prompts' answer tokens by category. A
    BPE vocabulary numbers its tokens in merge order, which follows how common they were in the
    tokenizer's own corpus, so the low ids are the likely rest (filled to 8 192: 61-91%). The
    head scores each with the target's own output row, so an unseen token is still drafted where
    the predicted feature points at it."""
    ids, counts = np.unique(labels, return_counts=True)
    seen = ids[np.lexsort((ids, -counts))][:size]
    rest = np.setdiff1d(np.arange(min(vocab_size, size + len(seen))), seen)[: size - len(seen)]
    return np.concatenate([seen, rest]).astype(np.int32)


def start_positions(f: Features, steps: int) -> np.ndarray:
    """Every t whose chain (t + 1 .. t + steps) stays inside its window."""
    out = [np.arange(a, b - steps - 1) for a, b in zip(f.starts[:-1], f.starts[1:]) if b - a > steps + 1]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


class _Batches:
    """What one update needs, gathered from the cached features for start positions t."""

    def __init__(self, f: Features, index: np.ndarray, steps: int, device: str = "cpu"):
        self.f, self.index, self.steps, self.device = f, index, steps, device

    def __call__(self, t: np.ndarray):
        import torch

        ahead = t[:, None] + 1 + np.arange(self.steps)  # [B, steps]: t + 1 .. t + steps
        parts = (
            self.f.hidden[t],  # [B, d] (float16, made float32 where the update runs)
            self.index[self.f.tokens[ahead]],  # [B, steps] embedding rows
            self.index[self.f.labels[ahead]],  # [B, steps] draft-vocabulary labels
            self.f.hidden[ahead],  # [B, steps, d]
        )
        out = [torch.from_numpy(np.ascontiguousarray(p)).to(self.device) for p in parts]
        return out[0].float(), out[1], out[2], out[3].float()


def _losses(model, config: TrainConfig, batch, outside: int):
    """(loss, per-step agreement counts [steps], counted rows) for one batch."""
    import torch
    from torch.nn import functional as F

    h, tokens, labels, target_features = batch
    if config.kind == "medusa":
        logits = model(h)
        features = None
    else:
        features, logits = model(h, tokens)
    loss = 0.0
    agree = []
    valid = labels != outside  # a label outside the draft vocabulary cannot be drafted: not learned
    for i, step_logits in enumerate(logits):
        target = torch.where(valid[:, i], labels[:, i], torch.full_like(labels[:, i], -100))
        loss = loss + F.cross_entropy(step_logits, target, ignore_index=-100)
        agree.append(((step_logits.argmax(-1) == labels[:, i]) & valid[:, i]).float())
        if features is not None:
            loss = loss + config.feature_weight * F.smooth_l1_loss(features[i], target_features[:, i])
    return loss / len(logits), torch.stack(agree, 1)  # [B, steps]


def evaluate(model, config: TrainConfig, batches: _Batches, positions: np.ndarray, outside: int) -> dict:
    """Held-out agreement with the target's greedy token by position (the text fed as the prefix:
    teacher forcing), and the chain's: the share whose first i + 1 guesses all agree, whose sum
    + 1 estimates the tokens a step emits at temperature 0."""
    import torch

    if len(positions) == 0:
        return {}
    rows = []
    with torch.no_grad():
        for start in range(0, len(positions), 512):
            rows.append(_losses(model, config, batches(positions[start : start + 512]), outside)[1].cpu().numpy())
    agree = np.concatenate(rows)  # [n, steps]
    chain = np.cumprod(agree, axis=1).mean(0)
    return {
        "positions": int(len(positions)),
        "agreement": [round(float(a), 4) for a in agree.mean(0)],
        "chain": [round(float(c), 4) for c in chain],
        "tokens_per_step": round(1.0 + float(chain.sum()), 3),
    }


def _save_checkpoint(path: Path, model, optimizer, update: int, config: TrainConfig) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(
        {"config": asdict(config), "update": update, "model": model.state_dict(), "optimizer": optimizer.state_dict()},
        buf,
    )
    write_atomically(path, buf.getvalue())


def train(target, f: Features, config: TrainConfig, out: Path, data: dict, progress: bool = True) -> headfile.HeadInfo:
    """Train, write the head file `out`; its info. Ctrl-C leaves `out`.ckpt, which the same call resumes."""
    try:
        import torch
    except ImportError as exc:
        raise SpecdecError("training a head needs torch: pip install -e '.[train]' (in specdec's checkout)") from exc
    from ..drafters.head_net import build, file_tensors

    torch.manual_seed(config.seed)
    d = target.n_embd
    if config.kind == "prophet" and d % config.n_head:
        raise SpecdecError(f"--heads {config.n_head} must divide the hidden width {d}")
    training, held = f.split()
    vocab = draft_vocabulary(training.labels, config.vocab, target.vocab_size)
    outside = len(vocab)
    index = np.full(target.vocab_size, outside, np.int64)  # target id -> draft-vocabulary row
    index[vocab] = np.arange(len(vocab))
    lm_head = torch.from_numpy(target.head_weights("output", vocab))  # [V, d]
    embed = torch.from_numpy(target.head_weights("embedding", vocab)) if config.kind == "prophet" else None
    device = device_of(target)
    model = build(config.kind, lm_head, embed, config.steps, config.n_head, config.n_ff).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0)
    positions = start_positions(training, config.steps)
    if len(positions) == 0:
        raise SpecdecError("not enough training text for one chain: give more with --data or --tokens")
    total = max(1, int(config.epochs * len(positions) / config.batch))

    batches = _Batches(training, index, config.steps, device)

    def step(rng) -> str:
        t = rng.choice(positions, size=min(config.batch, len(positions)), replace=False)
        loss, agree = _losses(model, config, batches(t), outside)
        loss.backward()
        return f"loss {loss.item():.3f} agree@1 {agree[:, 0].mean().item():.2f}"

    update, seconds = run_updates(model, optimizer, config, total, out, f"train {config.kind}", step, progress)
    model.eval()
    held_out = evaluate(
        model, config, _Batches(held, index, config.steps, device), start_positions(held, config.steps), outside
    )
    info = headfile.HeadInfo(
        kind=config.kind,
        target_sha256=target.identity,
        target_name=getattr(target, "description", target.name),
        n_embd=d,
        vocab_size=target.vocab_size,
        steps=config.steps,
        n_head=config.n_head if config.kind == "prophet" else 0,
        n_ff=config.n_ff if config.kind == "prophet" else 0,
        data=data,
        training={
            **asdict(config),
            "tokens": int(len(training.tokens)),
            "updates": update,
            "seconds_this_run": round(seconds, 3),
            "device": device,
        },
        held_out=held_out,
    )
    headfile.save(out, info, file_tensors(model, vocab))
    checkpoint_path(out).unlink(missing_ok=True)
    return info


def checkpoint_path(out) -> Path:
    """Where a head file's training keeps its checkpoint until the file is written: beside it."""
    return Path(str(out) + ".ckpt")


def run_updates(module, optimizer, config, total: int, out, label: str, step, progress: bool = True):
    """The loop every trainer shares: `total` updates, each `step(rng)` computing the gradients
    (it returns the progress bar's text; zero_grad and the optimiser's step are here), the learning
    rate decaying linearly to 5% of config.lr, and a checkpoint of `module` and the optimiser at
    `out`.ckpt every CHECKPOINT_SECONDS and on Ctrl-C, resumed from when its config is this one.
    -> (updates done, seconds this run took)."""
    import torch

    checkpoint = checkpoint_path(out)
    update = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True, map_location=next(module.parameters()).device)
        if saved["config"] == asdict(config):
            module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            update = saved["update"]
    rng = np.random.default_rng([config.seed, update])
    bar = Progress(label, total, "updates", progress)
    started = saved_at = time.perf_counter()
    try:
        while update < total:
            for group in optimizer.param_groups:  # linear decay to 5%
                group["lr"] = config.lr * max(0.05, 1.0 - update / total)
            optimizer.zero_grad()
            text = step(rng)
            optimizer.step()
            update += 1
            bar.update(update, text)
            if time.perf_counter() - saved_at > CHECKPOINT_SECONDS:
                _save_checkpoint(checkpoint, module, optimizer, update, config)
                saved_at = time.perf_counter()
    except KeyboardInterrupt:
        _save_checkpoint(checkpoint, module, optimizer, update, config)
        raise
    finally:
        bar.update(update, force=True)
        bar.close()
    return update, time.perf_counter() - started
