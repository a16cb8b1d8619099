"""The heads in torch, for training: the same math as drafters.head's NumPy, on batches.

Parameter names are the head file's tensor names (drafters.headfile), so a state dict saves as is.
The output head (`lm_head`, the target's own rows for the draft vocabulary) is a frozen buffer.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class Medusa(nn.Module):
    """n residual blocks on the target's hidden state; block i guesses the token i + 2 places on."""

    def __init__(self, lm_head: torch.Tensor, n_heads: int):
        super().__init__()
        d = lm_head.shape[1]
        self.register_buffer("lm_head", lm_head)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n_heads))
        for block in self.blocks:  # start as the target's own head: h + SiLU(0) = h
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        """h [B, d] -> per head the logits [B, V] over the draft vocabulary."""
        return [(h + F.silu(block(h))) @ self.lm_head.T for block in self.blocks]

    def step_logits(self, h: torch.Tensor, rows, i: int, keys: list, values: list):
        """Drafting step i (see `draft`): head i on h; the state stays h (the heads read no tokens)."""
        return h, (h + F.silu(self.blocks[i](h))) @ self.lm_head.T

    def head_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, block in enumerate(self.blocks):
            out[f"medusa.{i}.weight"], out[f"medusa.{i}.bias"] = block.weight, block.bias
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Prophet(nn.Module):
    """One transformer layer over (feature, next token's embedding) -> the next feature; run as a
    chain, each step attending to the chain's earlier steps."""

    def __init__(self, lm_head: torch.Tensor, embed: torch.Tensor, steps: int, n_head: int, n_ff: int):
        super().__init__()
        d = lm_head.shape[1]
        self.n_head, self.steps = n_head, steps
        self.register_buffer("lm_head", lm_head)
        # the target's embeddings of the draft vocabulary, and one learned row for every other token
        self.embed = nn.Parameter(torch.cat([embed, embed.mean(0, keepdim=True)]))
        self.fuse = nn.Linear(2 * d, d, bias=False)
        self.step = nn.Parameter(torch.zeros(steps, d))
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.empty(d, d)) for _ in range(4))
        self.w_gate, self.w_up = nn.Parameter(torch.empty(n_ff, d)), nn.Parameter(torch.empty(n_ff, d))
        self.w_down = nn.Parameter(torch.zeros(d, n_ff))
        for w in (self.wq, self.wk, self.wv, self.w_gate, self.w_up):
            nn.init.normal_(w, std=1 / math.sqrt(d))
        nn.init.zeros_(self.wo)  # the residual path starts as the fused input alone
        with torch.no_grad():  # start by passing the feature through: fuse = [I, 0]
            self.fuse.weight.zero_()
            self.fuse.weight[:, :d] = torch.eye(d)

    def _step(self, feature: torch.Tensor, rows: torch.Tensor, i: int, keys: list, values: list) -> torch.Tensor:
        """Chain step i: feature [B, d] and the embedding rows [B] of the token after it -> the
        next feature [B, d]; keys and values gather the chain's steps for its attention."""
        B, d = feature.shape
        H, hd = self.n_head, d // self.n_head
        x = self.fuse(torch.cat([feature, self.embed[rows]], -1)) + self.step[i]  # [B, d]
        h = rms_norm(x, self.attn_norm)
        q = (h @ self.wq.T).view(B, H, hd)
        keys.append((h @ self.wk.T).view(B, H, hd))
        values.append((h @ self.wv.T).view(B, H, hd))
        k, v = torch.stack(keys, 2), torch.stack(values, 2)  # [B, H, i + 1, hd]
        scores = torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(hd)
        attn = torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v).reshape(B, d)
        x = x + attn @ self.wo.T
        h = rms_norm(x, self.ffn_norm)
        return x + (F.silu(h @ self.w_gate.T) * (h @ self.w_up.T)) @ self.w_down.T

    def forward(self, feature: torch.Tensor, tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """feature [B, d] (the target's, at the chain's start); tokens [B, n] (embedding rows: the
        token after each step's feature). -> per step the predicted feature [B, d] and logits [B, V];
        each step's feature is the previous step's prediction (the chain runs as it will draft)."""
        keys, values, features, logits = [], [], [], []
        for i in range(tokens.shape[1]):
            feature = self._step(feature, tokens[:, i], i, keys, values)
            features.append(feature)
            logits.append(feature @ self.lm_head.T)
        return features, logits

    def step_logits(self, feature: torch.Tensor, rows: torch.Tensor, i: int, keys: list, values: list):
        """Drafting step i (see `draft`): the next feature and its logits over the draft vocabulary."""
        feature = self._step(feature, rows, i, keys, values)
        return feature, feature @ self.lm_head.T

    def head_tensors(self) -> dict[str, torch.Tensor]:
        names = ("embed", "step", "attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
        return {"fuse.weight": self.fuse.weight, **{name: getattr(self, name) for name in names}}


def build(kind: str, lm_head: torch.Tensor, embed: torch.Tensor | None, steps: int, n_head: int = 0, n_ff: int = 0):
    """A head of `kind` on the draft vocabulary's rows of the output head (and, for the prophet, of
    the input embedding): Medusa with `steps` heads, or the prophet's chain of `steps`."""
    if kind == "medusa":
        return Medusa(lm_head, steps)
    return Prophet(lm_head, embed, steps, n_head, n_ff)


def file_tensors(head: Medusa | Prophet, vocab: np.ndarray) -> dict[str, np.ndarray]:
    """A head's tensors as its file keeps them (drafters.headfile): float16, with the draft
    vocabulary (target ids, int32) and its rows of the output head."""
    tensors = {name: t.detach().cpu().numpy().astype(np.float16) for name, t in head.head_tensors().items()}
    return {**tensors, "vocab": np.asarray(vocab, np.int32), "lm_head": head.lm_head.cpu().numpy().astype(np.float16)}


@torch.no_grad()
def draft(head: Medusa | Prophet, state: torch.Tensor, rows: torch.Tensor, k: int, width: int = 1) -> torch.Tensor:
    """Greedy drafting with either head: the target's state [B, d] and the embedding rows [B] of
    the token after it -> k choices [B, k] (draft-vocabulary indices, each its own embedding row).
    With width w > 1, [B, k, w]: at each step the w best rows, best first, ties by index (as
    drafters.model.siblings takes them), the chain going on from the first (a fishbone's levels)."""
    keys: list = []
    values: list = []
    out = []
    for i in range(k):
        state, logits = head.step_logits(state, rows, i, keys, values)
        best = [logits.argmax(-1)]
        if width > 1:  # argmax again with the ones taken masked out: the first maximum each time
            logits = logits.clone()
            for _ in range(width - 1):
                logits.scatter_(-1, best[-1][:, None], float("-inf"))
                best.append(logits.argmax(-1))
        rows = best[0]
        out.append(torch.stack(best, -1) if width > 1 else rows)
    return torch.stack(out, 1)


def load_head(module: nn.Module, tensors: dict) -> None:
    """Set a module's weights from a head file's tensors (drafters.headfile.load)."""
    with torch.no_grad():
        for name, param in module.head_tensors().items():
            param.copy_(torch.from_numpy(tensors[name]))
