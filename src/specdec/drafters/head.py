"""A trained head drafts from the target's own hidden state (train/ makes one: `specdec train`).

Between steps the target's cache holds the context but its last token; the hidden state of the
last cached token (position len(context) - 2, after the final norm) is the vector the target
turned into the logits that chose context[-1]. Both kinds start from it:

- medusa (Cai et al. 2401.10774): head i is a residual block h + SiLU(W_i h + b_i) followed by the
  target's output head, and guesses the token i + 1 places after context[-1]. The heads do not
  see each other's guesses: each token is drawn from its own head's q.
- prophet (EAGLE-style, Li et al. 2401.15077): one small transformer layer over (a feature, the
  embedding of the next token) predicts the next feature, which the target's output head turns
  into a token; then it runs again on its own prediction and the token it drew. Its attention
  spans the chain of this proposal (the target's feature already sums up the context), so it
  keeps no cache between steps.

Both draft from a reduced vocabulary (the tokens the target predicted most in training): q is zero
outside it, which the rejection rule handles exactly (such a token is never drafted). The math is
NumPy here, mirrored by drafters.head_net in torch (a test holds them equal).

With `width` w > 1 a head drafts a tree (on the host, in NumPy, for any target that scores trees;
a greedy k x w tree on a torch target on its device, all rows at once):
- k x w: at each depth the head's own token continues the chain and the next w - 1 candidates of
  the same distribution hang beside it as leaves (drafters.model's tree);
- with `nodes` n as well, the n nodes of the most probable paths (the product of the head's
  probabilities from the root, drafters.model.shaping_probs: sampled, never a node's own drawn
  value), each node with up to w children, grown best first (EAGLE-2's
  dynamic tree). A medusa head's children depend only on their depth (its heads do not see the
  path), so the tree is Medusa's: every node at a depth offers the same candidates (greedy), or
  draws its own from the same q (sampled). A prophet runs its layer once for each node whose
  children the tree looks at, on that node's own path.
Greedy candidates are the head's best tokens (q None); sampled ones are drawn from q without
replacement, kept in the order drawn, so sampling.verify_tree's rule keeps the output exact.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from typing import Mapping, Sequence

import numpy as np

from ..acceptance import K_MAX
from ..errors import SpecdecError
from ..models.base import HiddenStates
from ..models.numpy_ref import rms_norm, silu
from ..sampling import SamplingParams, draft_token
from .base import Declared, Draft, fit_tree, tree_shape
from .model import shaping_probs, siblings

NORM_EPS = 1e-6  # the prophet's RMS norms (drafters.head_net.rms_norm's default)


def medusa_features(w: dict, h: np.ndarray, n: int) -> np.ndarray:
    """The first n medusa heads on hidden state h [d] -> [n, d] (each then goes through lm_head)."""
    return np.stack([h + silu(w[f"medusa.{i}.weight"] @ h + w[f"medusa.{i}.bias"]) for i in range(n)])


class ProphetChain:
    """One proposal's run of the prophet layer: `step(feature, token)` -> the next feature [d];
    its attention spans the steps taken so far."""

    def __init__(self, w: dict, n_head: int):
        self.w, self.n_head = w, n_head
        self.keys: list[np.ndarray] = []  # per step [n_head, head_dim]
        self.values: list[np.ndarray] = []

    def copy(self) -> "ProphetChain":
        """The chain so far, to go on along another path (a tree's branch)."""
        other = ProphetChain(self.w, self.n_head)
        other.keys, other.values = list(self.keys), list(self.values)
        return other

    def step(self, feature: np.ndarray, token_index: int) -> np.ndarray:
        w, H = self.w, self.n_head
        i = len(self.keys)
        x = w["fuse.weight"] @ np.concatenate([feature, w["embed"][token_index]]) + w["step"][i]  # [d]
        h = rms_norm(x, w["attn_norm"], NORM_EPS)
        d = x.shape[0]
        q, k, v = ((w[name] @ h).reshape(H, d // H) for name in ("wq", "wk", "wv"))  # [H, hd]
        self.keys.append(k)
        self.values.append(v)
        keys, values = np.stack(self.keys, 1), np.stack(self.values, 1)  # [H, i + 1, hd]
        # math.sqrt, not np.sqrt: a NumPy float64 scalar would make the chain float64, and every
        # matvec after it would copy its float32 weights to float64 first (10x slower here)
        scores = np.einsum("hd,hsd->hs", q, keys) / math.sqrt(d // H)  # [H, i + 1]
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = np.einsum("hs,hsd->hd", scores / scores.sum(-1, keepdims=True), values).reshape(d)
        x = x + w["wo"] @ attn
        h = rms_norm(x, w["ffn_norm"], NORM_EPS)
        return x + w["w_down"] @ (silu(w["w_gate"] @ h) * (w["w_up"] @ h))  # [d]


class TorchHead:
    """The head on a torch target's device (drafters.head_net: the same math), its rows in one batch,
    float32 as the NumPy path. Greedy chains run whole on the device, one CUDA graph per (rows, k)
    there, and come back once; sampled ones step by step, each token drawn on the host from q as
    the NumPy path draws it."""

    def __init__(self, info, w: dict, device):
        import torch

        from .head_net import build, draft, load_head

        embed = torch.from_numpy(w["embed"][:-1]) if "embed" in w else None
        module = build(info.kind, torch.from_numpy(w["lm_head"]), embed, info.steps, info.n_head, info.n_ff)
        load_head(module, w)
        self.module, self.device, self.torch, self._draft = module.to(device).eval(), device, torch, draft
        self._graphs: dict[tuple[int, int], tuple] = {}

    def greedy(self, states: np.ndarray, rows: np.ndarray, k: int, width: int = 1) -> np.ndarray:
        """states [B, d], rows [B] (the embedding row of each state's next token) -> [B, k] rows,
        or with width w > 1 [B, k, w]: each step's w best, the chain going on from the first."""
        torch = self.torch
        state, index = torch.from_numpy(states).to(self.device), torch.from_numpy(rows).to(self.device)
        if self.device.type != "cuda":
            return self._draft(self.module, state, index, k, width).numpy()
        key = (len(rows), k, width)
        if key not in self._graphs:
            from ..models.transformers import cuda_graph

            inputs = (state.clone(), index.clone())
            with torch.inference_mode():
                graph, out = cuda_graph(lambda: self._draft(self.module, *inputs, k, width))
            self._graphs[key] = (graph, inputs, out)
        graph, (state_in, index_in), out = self._graphs[key]
        state_in.copy_(state)
        index_in.copy_(index)
        graph.replay()
        return out.cpu().numpy()

    def sampled(self, states: np.ndarray, rows: np.ndarray, k: int, choose) -> None:
        """Step by step: choose(i, logits [B, V] on the host) -> the rows drawn at step i [B]."""
        torch = self.torch
        with torch.inference_mode():
            state, index = torch.from_numpy(states).to(self.device), torch.from_numpy(rows).to(self.device)
            keys: list = []
            values: list = []
            for i in range(k):
                state, logits = self.module.step_logits(state, index, i, keys, values)
                index = torch.from_numpy(choose(i, logits.cpu().numpy())).to(self.device)


def held_out_prior(info) -> list[float] | None:
    """P(position i kept | the ones before were), from the held-out agreement a head file holds
    (teacher-forced, so an upper estimate: auto's own observations take over), 0 past the
    positions it drafts; None where the file has none."""
    chain = (info.held_out or {}).get("chain")
    if not chain:
        return None
    survive = [1.0, *chain]
    rates = [min(1.0, b / a) if a > 0 else 0.0 for a, b in zip(survive, survive[1:])]
    return rates + [0.0] * (K_MAX - len(rates))


class HeadDrafter(Declared):
    """Drafts for the target's own rows (the engine's row ids are the target's)."""

    takes = frozenset()  # propose's keywords beyond (contexts, ks, leaves): Drafter.takes

    def __init__(self, target, path, width: int = 1, nodes: int = 0):
        from . import headfile

        shape = tree_shape(width, nodes)
        if not isinstance(target, HiddenStates):
            raise SpecdecError(
                f"a trained head drafts from the target's hidden states, which {type(target).__name__} "
                f"does not give (the llama, numpy and torch backends do)"
            )
        self.info, self.w = headfile.load(path)
        headfile.check_target(self.info, target, path)
        if self.info.vocab_size != target.vocab_size or self.info.n_embd != target.n_embd:
            raise SpecdecError(f"head {path} does not fit {target.name}'s shape; train it again")
        self.target = target
        target.keep_hidden()
        self.vocab = self.w["vocab"].astype(np.int64)  # [V] target ids
        # target id -> the head's embedding row (the last one: any token outside the vocabulary)
        self.index = np.full(target.vocab_size, len(self.vocab), np.int64)
        self.index[self.vocab] = np.arange(len(self.vocab))
        # on a torch target the head runs on the target's device (on a GPU its chain is a CUDA
        # graph: the NumPy chain on the host would cost more than the target's step); elsewhere
        # the NumPy math runs on the host
        device = getattr(target, "device", None)
        self._torch = TorchHead(self.info, self.w, device) if hasattr(device, "type") else None
        self.kind = "head"
        self.width, self.nodes = width, nodes
        self.name = f"head:{self.info.kind}{shape}"
        self._rows: dict[int, tuple[SamplingParams, np.random.Generator]] = {}

    @property
    def max_k(self) -> int:
        """Medusa drafts at most one token per head; the prophet's learned step positions end at
        the chain it was trained on."""
        return self.info.steps

    @property
    def prior(self) -> list[float] | None:
        return held_out_prior(self.info)

    def lag(self, row: int, context: Sequence[int]) -> int:
        """What auto asks of a draft model: nothing to catch up on (the head reads the target's state)."""
        return 0

    def cost_curve(self, repeats: int = 5) -> dict[int, float]:
        """auto's price of drafting w tokens (over all rows) with this head: w chain steps (a
        medusa head's, a prophet's), timed here on a random state, the median of `repeats`."""
        rng = np.random.default_rng(0)
        h = rng.standard_normal(self.target.n_embd).astype(np.float32)
        params = SamplingParams()
        seconds = []
        for _ in range(repeats):
            t = time.perf_counter()
            self._draft_rows({0: (h, 0, self.max_k)}, {0: (params, rng)})
            seconds.append((time.perf_counter() - t) / self.max_k)
        step = float(np.median(seconds))
        return {w: w * step for w in (1, 2, 4, 8, 16, 32)}

    def begin(self, row: int, prompt: Sequence[int], params: SamplingParams, rng: np.random.Generator) -> None:
        self._rows[row] = (params, rng)

    def end(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows.pop(row, None)

    def accept(self, n_accepted: Mapping[int, int]) -> None:
        pass  # nothing kept: the next proposal starts from the target's new hidden state

    def _token(self, head_logits: np.ndarray, params: SamplingParams, rng: np.random.Generator):
        """A token drawn from the output head's logits over the draft vocabulary, and q over the
        target's whole vocabulary."""
        logits = np.full(self.target.vocab_size, -np.inf, np.float32)  # [vocab]: q is 0 outside the head's
        logits[self.vocab] = head_logits
        return draft_token(logits, params, rng)

    def propose(
        self, contexts: Mapping[int, Sequence[int]], ks: Mapping[int, int], leaves: Mapping[int, int] | None = None
    ) -> dict[int, Draft]:
        kept = self.target.hidden_rows([row for row, k in ks.items() if k > 0])
        drafts, todo = {}, {}
        for row, k in ks.items():
            first, states = kept.get(row, (0, np.zeros((0, 1))))
            k = min(k, self.max_k, self.target.n_ctx - len(contexts[row]))
            # the last cached token's state, if the target kept it (not after a prefill without logits)
            if k <= 0 or len(states) == 0 or first + len(states) != len(contexts[row]) - 1:
                drafts[row] = Draft([])
            else:
                todo[row] = (states[-1], contexts[row][-1], k)
        return {**drafts, **self._draft_rows(todo, self._rows, leaves)}

    def _draft_rows(
        self, todo: Mapping[int, tuple], settings: Mapping[int, tuple], leaves: Mapping[int, int] | None = None
    ) -> dict[int, Draft]:
        """Per row (its state, the token after it, k) and (params, rng) -> its draft. A sampled
        row's tree keeps within leaves[row] (drafters.base.fit_tree: its shape chosen before it
        draws; 0 a chain); a greedy row's, of fixed candidates, need not."""
        shapes = {
            row: (self.width, self.nodes)
            if settings[row][0].greedy
            else fit_tree(self.width, self.nodes, k, (leaves or {}).get(row))
            for row, (_, _, k) in todo.items()
        }
        trees = {row: v for row, v in todo.items() if shapes[row][0] > 1}
        if trees:
            on_device = self._torch is not None
            if on_device and not self.nodes and all(settings[row][0].greedy for row in trees):
                out = self._fishbone_torch(trees)
            else:
                out = {row: self._tree(h, last, k, *settings[row], *shapes[row]) for row, (h, last, k) in trees.items()}
            chains = {row: v for row, v in todo.items() if row not in trees}
            return {**out, **self._draft_rows(chains, settings)} if chains else out
        on_device = self._torch is not None and bool(todo)
        if on_device:
            return self._draft_torch(todo, settings)
        return {row: self._draft(h, last, k, *settings[row]) for row, (h, last, k) in todo.items()}

    def _draft(self, h: np.ndarray, last: int, k: int, params, rng) -> Draft:
        tokens, q = [], []
        if self.info.kind == "medusa":
            for feature in medusa_features(self.w, h, k):
                token, row_q = self._token(self.w["lm_head"] @ feature, params, rng)
                tokens.append(token)
                q.append(row_q)
        else:
            chain = ProphetChain(self.w, self.info.n_head)
            feature, token = h, last
            for _ in range(k):
                feature = chain.step(feature, self.index[token])
                token, row_q = self._token(self.w["lm_head"] @ feature, params, rng)
                tokens.append(token)
                q.append(row_q)
        return Draft(tokens, None if q[0] is None else np.stack(q))

    def _tree(
        self, h: np.ndarray, last: int, k: int, params, rng, width: int | None = None, nodes: int | None = None
    ) -> Draft:
        """A tree of depth <= k from state h whose next token is `last` (the module docstring), of
        `width` candidates a depth and `nodes` nodes (0: the fishbone; None: the drafter's own)."""
        width = self.width if width is None else width
        nodes = self.nodes if nodes is None else nodes
        medusa: dict = {}  # depth -> that medusa head's logits (greedy: its candidates)

        def children(path_state, depth: int):
            """The candidates at `depth` under a node: (tokens, probabilities, q, the state their
            own children grow from, one per candidate)."""
            chain = feature = None
            if self.info.kind == "medusa":
                if depth not in medusa:
                    medusa[depth] = self.w["lm_head"] @ medusa_features(self.w, h, depth + 1)[depth]
                    if params.greedy:  # the same candidates under every node of the depth
                        medusa[depth] = self._best(medusa[depth])
                if params.greedy:
                    return medusa[depth]
                head_logits = medusa[depth]
            else:
                chain, feature, token = path_state
                chain = chain.copy()
                feature = chain.step(feature, self.index[token])
                head_logits = self.w["lm_head"] @ feature
                if params.greedy:
                    tokens, probs, q, _ = self._best(head_logits)
                    return tokens, probs, q, [(chain, feature, t) for t in tokens]
            # sampled: q over the target's vocabulary (0 outside the head's), as the chain draws it
            first, q = self._token(head_logits, params, rng)
            tokens = [first, *siblings(None, first, q, width - 1, rng)]
            states = [None if chain is None else (chain, feature, t) for t in tokens]
            return tokens, shaping_probs(None, q, tokens), q, states

        root = None if self.info.kind == "medusa" else (ProphetChain(self.w, self.info.n_head), h, last)
        tokens, parents, q = [], [], []
        if not nodes:  # the chain with w - 1 leaves a depth
            state, above = root, -1
            for depth in range(k):
                level, _, row_q, states = children(state, depth)
                for t in level:
                    tokens.append(t)
                    parents.append(above)
                    q.append(row_q)
                above, state = len(tokens) - len(level), states[0]
        else:  # the `nodes` most probable paths, best first
            # (-path probability, tie, parent node, the parent's path probability, depth, level, candidate)
            heap: list[tuple] = []
            order = itertools.count()  # ties go to the candidate found first

            def push(parent: int, above: float, depth: int, level, j: int) -> None:
                heapq.heappush(heap, (-above * level[1][j], next(order), parent, above, depth, level, j))

            push(-1, 1.0, 0, children(root, 0), 0)
            while heap and len(tokens) < nodes:
                negative, _, parent, above, depth, level, j = heapq.heappop(heap)
                node = len(tokens)
                tokens.append(level[0][j])
                parents.append(parent)
                q.append(level[2])
                if j + 1 < len(level[0]):  # the candidate after it under the same parent
                    push(parent, above, depth, level, j + 1)
                if depth + 1 < k:  # its own children open below it
                    push(node, -negative, depth + 1, children(level[3][j], depth + 1), 0)
        stacked = None if q[0] is None else np.stack(q)
        return Draft(tokens, stacked, {}, parents)

    def _best(self, head_logits: np.ndarray) -> tuple:
        """Greedy candidates from logits over the head's vocabulary: its `width` best tokens, best
        first (ties by draft-vocabulary row), their softmax probabilities, no q and no states."""
        first = int(np.argmax(head_logits))
        rows = [first, *siblings(head_logits, first, None, self.width - 1, None)]
        return self.vocab[rows].tolist(), shaping_probs(head_logits, None, rows), None, [None] * len(rows)

    def _device_inputs(self, todo: Mapping[int, tuple]) -> tuple[list[int], np.ndarray, np.ndarray, list[int]]:
        """The rows of `todo` (row -> (state, the token after it, k)), their states [rows, d] as
        float32, their next tokens' embedding rows and their ks, for TorchHead."""
        rows = list(todo)
        states = np.stack([todo[row][0] for row in rows]).astype(np.float32, copy=False)
        return rows, states, self.index[[todo[row][1] for row in rows]], [todo[row][2] for row in rows]

    def _fishbone_torch(self, todo: Mapping[int, tuple]) -> dict[int, Draft]:
        """Greedy k x w trees, all rows at once on the target's device: the chain of each step's
        best and, beside each of its nodes, the next w - 1 of the same step (what _tree builds on
        the host node by node)."""
        rows, states, index, ks = self._device_inputs(todo)
        chosen = self._torch.greedy(states, index, max(ks), self.width)  # [rows, k, w]
        out = {}
        for j, row in enumerate(rows):
            levels = self.vocab[chosen[j, : ks[j]]]  # [k, w] target ids
            parents = [-1 if d == 0 else (d - 1) * self.width for d in range(ks[j]) for _ in range(self.width)]
            out[row] = Draft(levels.reshape(-1).tolist(), None, {}, parents)
        return out

    def _draft_torch(self, todo: Mapping[int, tuple], settings: Mapping[int, tuple]) -> dict[int, Draft]:
        """All rows' chains at once on the target's device (TorchHead), as long as the longest."""
        rows, states, index, ks = self._device_inputs(todo)
        if all(settings[row][0].greedy for row in rows):
            chosen = self._torch.greedy(states, index, max(ks))  # [rows, k] draft-vocabulary rows
            return {row: Draft(self.vocab[chosen[j, : ks[j]]].tolist()) for j, row in enumerate(rows)}
        tokens: dict[int, list] = {row: [] for row in rows}
        q: dict[int, list] = {row: [] for row in rows}

        def choose(i: int, logits: np.ndarray) -> np.ndarray:
            drawn = logits.argmax(-1)  # a row past its own k draws nothing from its rng
            for j, row in enumerate(rows):
                if i < ks[j]:
                    token, row_q = self._token(logits[j], *settings[row])
                    drawn[j] = self.index[token]
                    tokens[row].append(token)
                    q[row].append(row_q)
            return drawn

        self._torch.sampled(states, index, max(ks), choose)
        return {row: Draft(tokens[row], None if q[row][0] is None else np.stack(q[row])) for row in rows}
