"""Sampling filters and lossless verification of drafted tokens.

Words: ``p`` is always the target model's distribution, ``q`` the drafter's.
A drafter proposes k tokens; the target scores ``[last, *draft]`` and gives
k + 1 rows. Verification accepts a prefix of the draft and then emits one more
token: the *recovered* token (sampled from the residual norm(max(0, p - q)) at
the first rejection) or the *bonus* token (sampled from p row k when all k
drafted tokens are accepted). With this rule the emitted tokens are distributed
exactly as if sampled from p alone (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318).

Beside that token-by-token rule: block verification of a chain (verify_block, Sun et al. 2025,
arXiv:2403.10444), which keeps as long a prefix as any rule can while the emitted tokens still
follow p; and the rules for several drafts (verify_candidates for the candidates of one position,
verify_tree for a tree of them: node by node down the accepted path, or by block verification
generalised to trees, tree_block_cuts, which walks the tree from its leaves up).

Pure functions of numpy arrays; no model state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .models.base import tree_depths

__all__ = [
    "SamplingParams",
    "logits_to_probs",
    "sample",
    "residual",
    "verify_greedy",
    "verify_stochastic",
    "verify",
    "verify_block",
    "verify_candidates",
    "verify_tree",
    "tree_block_cuts",
    "verify_tree_greedy",
    "expected_kept",
    "expected_tree_kept",
    "DraftTree",
    "VERIFICATION_RULES",
    "CHAIN_RULES",
    "TREE_RULES",
    "draft_token",
]

# how a sampled chain or tree drafted from a real q is verified: "block" (the default: a chain by
# verify_block, never fewer tokens kept in expectation than token by token; a tree node by node),
# "token" (verify_stochastic token by token; a tree node by node) or "traversal" (a chain by
# verify_block; a tree by block verification's tree form, tree_block_cuts: on the draft model's
# grown trees it kept what node by node keeps, +-1%, at ten times the host time, so not the default)
VERIFICATION_RULES = ("block", "token", "traversal")
# what each rule does to a chain ("block" or "token") and to a tree ("traversal" or "token": node by
# node), the one place that says so: the verifiers read it, and a benchmark that prices every rule
# computes each distinct one once
CHAIN_RULES = {"block": "block", "token": "token", "traversal": "block"}
TREE_RULES = {"block": "token", "token": "token", "traversal": "traversal"}


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. Defaults: greedy, all filters off."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 = sample
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus: smallest set with cumulative prob >= top_p; 1.0 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # `not >=` also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Logits [rows, vocab] or [vocab] -> float64 probabilities of the same shape.

    Filter order: top-k, then temperature + softmax, then top-p, then min-p,
    renormalising after each. (llama.cpp's default chain applies temperature last,
    after min-p; for losslessness only p and q sharing one order matters.)
    Greedy params give the one-hot of the argmax (ties -> lowest index).

    Ties are deterministic and index-independent: top-k keeps every token whose
    logit equals the k-th largest (so it may keep more than k); top-p keeps every
    token whose probability equals that of the last token needed to reach top_p;
    min-p keeps tokens with prob >= min_p * max prob.
    """
    logits = np.asarray(logits)
    if params.greedy:
        x = logits.reshape(-1, logits.shape[-1])  # [rows, vocab]
        out = np.zeros(x.shape)  # [rows, vocab]
        out[np.arange(x.shape[0]), np.argmax(x, axis=1)] = 1.0
        return out.reshape(logits.shape)

    x = logits.reshape(-1, logits.shape[-1])  # [rows, vocab] a view, input dtype
    vocab = x.shape[1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    # one output array, then everything in place: on glibc every fresh ~1 MB temporary can
    # cost page faults (~0.4 ms on a 152k vocab), more than the arithmetic itself
    out = np.zeros(x.shape) if top_k else np.array(x, dtype=np.float64)  # [rows, vocab]
    for r in range(x.shape[0]):
        if top_k:
            # k-th largest logit by np.partition (O(vocab), no full sort); then work on the
            # kept tokens only, so the later filters cost O(k)
            kth = np.partition(x[r], vocab - top_k)[vocab - top_k]
            keep = np.flatnonzero(x[r] >= kth)  # [>= top_k] token ids; ties at the cut kept
            z = x[r, keep].astype(np.float64)  # [kept]
        else:
            keep, z = None, out[r]  # [vocab] a view: updated in place
        # subtract the max before dividing so a tiny temperature cannot overflow to inf - inf
        z -= z.max()
        z /= params.temperature
        np.exp(z, out=z)
        z /= z.sum()
        if params.top_p < 1.0:
            z[z < _top_p_cut(z, params.top_p)] = 0.0
            z /= z.sum()
        if params.min_p > 0.0:
            z[z < params.min_p * z.max()] = 0.0
            z /= z.sum()
        if keep is not None:
            out[r, keep] = z
    return out.reshape(logits.shape)


def _top_p_cut(probs: np.ndarray, top_p: float) -> float:
    """Smallest probability in the smallest top set of `probs` ([n], sums to 1) with mass >= top_p.

    Grows a candidate set of the largest probs with an in-place partition instead of
    sorting the whole vocabulary: a peaked row needs one O(vocab) pass and a sort of 64 values.
    """
    # [m] scratch copy without exact zeros (many ties slow np.partition down)
    buf = probs.copy() if probs.all() else probs[probs > 0]
    m = buf.size
    n = min(m, 64)
    while True:
        if 4 * n >= m:  # nearly everything is needed anyway: one full sort is cheaper
            n = m
            buf.sort()
            top = buf[::-1]  # [m] descending
        else:
            buf.partition(m - n)  # the n largest go to the end, in any order
            top = np.sort(buf[m - n :])[::-1]  # [n] descending
        cum = np.cumsum(top)  # [n]
        if cum[-1] >= top_p or n == m:
            # first position where the cumulative mass reaches top_p (clamped against rounding)
            return float(top[min(int(np.searchsorted(cum, top_p)), n - 1)])
        # every other token has prob <= top[-1], so at least `need` more are needed
        need = int((top_p - cum[-1]) / top[-1]) + 1
        n = max(8 * n, n + need)


def accept(rng: np.random.Generator, num: float, den: float) -> bool:
    """One Bernoulli draw, true with probability min(1, num / den) (den > 0): one rng.random(),
    compared as u * den < num (no division). Every accept-or-reject decision of the rules goes
    through here and every categorical draw through `sample`, so a test can enumerate each
    decision's outcomes with their exact probabilities (tests/enumerate.py)."""
    return rng.random() * den < num


def accepts(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """len(probs) Bernoulli draws at once (one rng.random(n)), draw i true with probability probs[i]."""
    return rng.random(len(probs)) < probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a [vocab] distribution by inverse CDF with one rng.random() draw.

    Never returns a zero-probability token: `side="right"` skips empty CDF steps.
    """
    cdf = np.cumsum(probs, dtype=np.float64)  # [vocab]
    total = cdf[-1]
    if not total > 0:
        raise ValueError("sample: probabilities sum to zero")
    u = rng.random()
    i = int(np.searchsorted(cdf, u * total, side="right"))
    if i >= cdf.size:  # u * total rounded up to total: take the last token with mass
        i = int(np.flatnonzero(probs)[-1])
    return i


def residual(p_row: np.ndarray, q_row: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)) as [vocab] float64; p itself when that is all zero (p == q)."""
    r = np.maximum(p_row - q_row, 0.0)  # [vocab]
    s = r.sum()
    if s <= 0.0:  # p == q: a rejection cannot happen; p is the safe answer
        return np.asarray(p_row, dtype=np.float64)
    return r / s


def _check_chain(p: np.ndarray, k: int, q: np.ndarray | None) -> None:
    if p.ndim != 2 or p.shape[0] != k + 1:
        raise ValueError(f"p must be [k + 1 = {k + 1}, vocab], got {p.shape}")
    if q is not None and q.shape != (k, p.shape[1]):
        raise ValueError(f"q must be [k, vocab] = {(k, p.shape[1])}, got {q.shape}")


def verify_greedy(target_logits: np.ndarray, draft_tokens: Sequence[int]) -> tuple[int, int]:
    """Greedy verification: accept while the draft token equals the target's argmax.

    target_logits [k + 1, vocab] (logits or probs). Returns (n_accepted, next_token),
    next_token = argmax of row n_accepted: the correction, or the bonus if all k match.
    """
    target_logits = np.asarray(target_logits)
    k = len(draft_tokens)
    if target_logits.ndim != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k + 1 = {k + 1}, vocab], got {target_logits.shape}")
    best = np.argmax(target_logits, axis=1)  # [k + 1]; argmax only, no softmax
    for i, x in enumerate(draft_tokens):
        if int(x) != best[i]:
            return i, int(best[i])
    return k, int(best[k])


def verify_stochastic(
    p: np.ndarray,
    draft_tokens: Sequence[int],
    q: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling verification; the emitted tokens are distributed as p.

    p [k + 1, vocab] target probabilities; q [k, vocab] draft probabilities (from
    logits_to_probs with the same params as p) or None = one-hot on the draft tokens.
    rng draws, in order: one rng.random() per examined draft token with q > 0,
    then one for the recovered or bonus token. Returns (n_accepted, next_token).
    """
    p = np.asarray(p)
    k = len(draft_tokens)
    _check_chain(p, k, q)
    for i, x in enumerate(draft_tokens):
        px = p[i, x]
        qx = 1.0 if q is None else q[i, x]
        # accept with prob min(1, p/q): u < p/q written as u * q < p (no division);
        # q == 0 rejects without drawing
        if qx > 0 and accept(rng, px, qx):
            continue
        if q is None:
            q_row = np.zeros(p.shape[1])  # [vocab] one-hot drafter: residual = p without x
            q_row[x] = 1.0
        else:
            q_row = q[i]
        return i, sample(residual(p[i], q_row), rng)
    return k, sample(p[k], rng)


def verify(
    logits: np.ndarray,
    draft_tokens: Sequence[int],
    q: np.ndarray | None,
    params: SamplingParams,
    rng: np.random.Generator,
    rule: str = "block",
) -> tuple[int, int]:
    """Greedy params: verify_greedy(logits); else the sampled rule on logits_to_probs(logits):
    verify_block for a draft with a real q when rule is "block" or "traversal", else
    verify_stochastic. (For a one-hot draft the two keep the same number of tokens in
    distribution, so it goes token by token, with fewer draws.)

    logits [k + 1, vocab] raw target logits; q as in verify_stochastic (ignored if greedy).
    """
    if params.greedy:
        return verify_greedy(logits, draft_tokens)
    p = logits_to_probs(logits, params)
    if CHAIN_RULES.get(rule) == "block" and q is not None:
        return verify_block(p, draft_tokens, q, rng)
    return verify_stochastic(p, draft_tokens, q, rng)


def block_weights(p: np.ndarray, draft_tokens: Sequence[int], q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block verification's numbers for a chain: (w [k + 1], h [k]). w[0] = 1 and
    w[i] = min(1, w[i - 1] p(x_i) / q(x_i)), the weight of the prefix of i tokens (0 once a token
    has q = 0); h[i - 1] is the chance of stopping after token i when no longer prefix is kept:
    w[k] for the whole chain, else s / (s + 1 - w[i]) with s = sum_x max(0, w[i] p_i+1(x) - q_i+1(x)),
    the mass the residual after i would hold (1 where both are 0: a later stop is then certain)."""
    k = len(draft_tokens)
    w, h = np.ones(k + 1), np.zeros(k)
    for i, x in enumerate(draft_tokens):
        qx = q[i, x]
        w[i + 1] = min(1.0, w[i] * p[i, x] / qx) if qx > 0 else 0.0
        if i + 1 == k:
            h[i] = w[k]
        else:
            s = float(np.maximum(w[i + 1] * p[i + 1] - q[i + 1], 0.0).sum())
            d = s + 1.0 - w[i + 1]
            h[i] = s / d if d > 0 else 1.0
    return w, h


def block_residual(p_row: np.ndarray, q_row: np.ndarray, weight: float) -> np.ndarray:
    """norm(max(0, weight * p - q)) [vocab]: what follows a block cut after a prefix of that
    weight; p itself where that is all zero (a cut that happens with probability 0)."""
    r = np.maximum(weight * p_row - q_row, 0.0)  # [vocab]
    s = r.sum()
    return r / s if s > 0 else np.asarray(p_row, dtype=np.float64)


def verify_block(
    p: np.ndarray, draft_tokens: Sequence[int], q: np.ndarray | None, rng: np.random.Generator
) -> tuple[int, int]:
    """Block verification (Sun et al. 2025, arXiv:2403.10444): one uniform draw per draft token
    decides, from the whole chain at once, the longest prefix to keep (the last i whose draw falls
    under h[i - 1] of block_weights), then one more draw samples the token after it, from p's last
    row if every token is kept, else from block_residual at the cut. The emitted tokens follow p
    exactly, as with verify_stochastic, and no rule that sees only the chain's own probabilities
    keeps more tokens in expectation (by the paper's theorem; for a one-hot q the two rules keep
    the same number). rng draws, in order: k uniforms (always all k), then one for the last token.
    p [k + 1, vocab], q [k, vocab] or None (one-hot on the draft). Returns (n_accepted, next_token)."""
    p = np.asarray(p)
    k = len(draft_tokens)
    _check_chain(p, k, q)
    if q is None:
        q = np.zeros((k, p.shape[1]))  # [k, vocab] one-hot on the draft tokens
        q[np.arange(k), list(draft_tokens)] = 1.0
    w, h = block_weights(p, draft_tokens, q)
    passed = np.flatnonzero(accepts(rng, h))  # [<= k] the prefixes (of i + 1 tokens) that may end the block
    n = int(passed[-1]) + 1 if passed.size else 0
    if n == k:
        return k, sample(p[k], rng)
    return n, sample(block_residual(p[n], q[n], w[n]), rng)


def verify_candidates(
    p_row: np.ndarray,
    candidates: Sequence[int],
    q_row: np.ndarray | None,
    rng: np.random.Generator,
    replacement: bool = True,
) -> tuple[int, int]:
    """Several drafts for one position (recursive rejection sampling): candidate i is tried against
    what is left of p after the earlier ones were rejected, r, and accepted with min(1, r(x) / q_i(x));
    on rejection r <- norm(max(0, r - q_i)). The token emitted follows p_row exactly when the
    candidates were drawn as `q_row` and `replacement` say:
    - q_row given, replacement True: candidates drawn independently from q_row (q_i = q_row);
    - q_row given, replacement False: each drawn from q_row without the earlier candidates
      (q_i = q_row with them removed, renormalised);
    - q_row None: chosen deterministically (e.g. the drafter's top k): q_i is one-hot, so
      candidate i is accepted with probability r(x), else removed from r (a repeat is then
      rejected for sure).
    After the last rejection the token is sampled from r. rng draws, in order: one uniform per
    candidate tried with q_i(x) > 0, then one for a sampled token. Returns (index of the accepted
    candidate or -1, the token)."""
    r = np.asarray(p_row, dtype=np.float64)  # [vocab]
    q_i = None if q_row is None else np.asarray(q_row, dtype=np.float64)  # [vocab]
    for i, x in enumerate(candidates):
        qx = 1.0 if q_i is None else q_i[x]
        if qx > 0 and accept(rng, r[x], qx):
            return i, int(x)
        r, q_i = _rejected(r, q_i, x, replacement)
    return -1, sample(r, rng)


def _rejected(r: np.ndarray, q_i: np.ndarray | None, x: int, replacement: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """What is left of p, and the next candidate's q, once candidate x was rejected (verify_candidates)."""
    if q_i is None:
        r = r.copy()  # r(x) < 1 here (a draw under 1 was not below it), so mass is left
        r[x] = 0.0
        return r / r.sum(), None
    r = residual(r, q_i)
    if not replacement:
        q_i = q_i.copy()
        q_i[x] = 0.0
        s = q_i.sum()
        q_i = q_i / s if s > 0 else q_i  # every token drafted: no further candidate can come
    return r, q_i


@dataclass(frozen=True)
class DraftTree:
    """Drafted tokens as a tree over the last verified token (the root): node i holds tokens[i]
    and hangs under parents[i] (-1: the root). Parents come before their children."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a tree needs a parent per token: {len(self.tokens)} tokens, {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} must be -1 (the root) or an earlier node")

    def children(self, node: int) -> list[int]:
        """The nodes under `node` (-1: the root), in order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]


def verify_tree(
    p: np.ndarray,
    tree: DraftTree,
    q: np.ndarray | None,
    rng: np.random.Generator,
    replacement: bool = True,
    rule: str = "block",
) -> tuple[list[int], int]:
    """A tree of drafts verified so that the tokens emitted follow p exactly when each node's
    children were drawn as `q` and `replacement` say (verify_candidates). Rules "block" (the
    default) and "token": node by node from the root, verify_candidates over the children of the
    node reached, and down into the one accepted, until none is or a leaf is reached; then the token
    after the path (the one verify_candidates sampled, or from p at the leaf). Rule "traversal": the
    tree is walked from its leaves up, a whole path judged at once (tree_block_cuts), which on a
    chain is block verification (verify_block) and can keep a path whose later token's p / q makes
    up for an earlier one's. For q None (children chosen deterministically) the two keep the same
    in distribution, so it goes node by node.
    p [n + 1, vocab]: row 0 the target's distribution after the root, row i + 1 after node i.
    q [n + 1, vocab] alike, the distribution each node's children were drawn from, or None for
    children chosen deterministically (a top-k tree). rng draws, rule "traversal": two uniforms (the
    node the path ends at, the token after it). Returns (the accepted path's nodes, root to leaf,
    the next token)."""
    p = np.asarray(p)
    _check_tree(p, tree, q)
    if TREE_RULES.get(rule) == "traversal" and q is not None:
        ends, after = tree_block_cuts(p, tree, q, replacement)
        end = sample(ends, rng)  # the row of the node the path ends at (0: the root, no node kept)
        path, node = [], end - 1
        while node >= 0:
            path.append(node)
            node = tree.parents[node]
        return path[::-1], sample(after[end], rng)
    path: list[int] = []
    node = -1
    while kids := tree.children(node):
        i, token = verify_candidates(
            p[node + 1], [tree.tokens[c] for c in kids], None if q is None else q[node + 1], rng, replacement
        )
        if i < 0:
            return path, token
        node = kids[i]
        path.append(node)
    return path, sample(p[node + 1], rng)


def _check_tree(p: np.ndarray, tree: DraftTree, q: np.ndarray | None) -> None:
    n = len(tree.tokens)
    if p.ndim != 2 or p.shape[0] != n + 1:
        raise ValueError(f"p must be [nodes + 1 = {n + 1}, vocab], got {p.shape}")
    if q is not None and q.shape != p.shape:
        raise ValueError(f"q must be [nodes + 1, vocab] = {p.shape}, got {q.shape}")


def tree_block_cuts(
    p: np.ndarray, tree: DraftTree, q: np.ndarray, replacement: bool = True
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """Block verification of a tree, as the chances of where the kept path ends: (ends [n + 1],
    after [n + 1]): ends[0] the chance that no node is kept, ends[i + 1] that the path to node i is,
    summing to 1; after[j] the distribution of the token that then follows (None where the walk
    never gets).
    p, q as in verify_tree (q real: each node's children drawn from its row, with or without
    replacement).

    The tree is walked leaves first (a node's subtrees in the order its children were drawn, then
    the node itself), as Weng et al.'s traversal verification (2025, arXiv:2505.12398) walks it,
    here with siblings drawn without replacement too. A node is entered with a weight w (the
    root's 1) and holds a measure m over the next token, w p at first, beside a mass b = 1 - w of
    "not this node". Its child x, drawn from the node's q_i, is entered with weight
    min(1, m(x) / (z q_i(x))), z = sum(m) + b; if nothing in the child's subtree is kept, the node
    holds what that child's draw did not cover, m <- max(0, m / z - q_i) and b <- b / z, and q_i
    loses x when drawn without replacement. Once its children are done the path ends at the node
    with chance sum(m) / (sum(m) + b), the next token drawn from norm(m); else the walk goes on to
    the node's next sibling, or up. By induction over the tree, a node entered with weight w emits
    w times the target's continuation after it, and "not this node" with 1 - w, over the draws of
    its subtree, whatever its shape, so the root (w = 1) emits p exactly; on a chain these are
    block_weights' numbers. (A child with q_i(x) = 0 has weight 0: its subtree is never kept.)"""
    n = len(tree.tokens)
    kids: list[list[int]] = [[] for _ in range(n + 1)]  # kids[j]: the children of row j's node
    for i, parent in enumerate(tree.parents):
        kids[parent + 1].append(i)
    ends = np.zeros(n + 1)
    after: list[np.ndarray | None] = [None] * (n + 1)

    def enter(node: int, weight: float, reach: float) -> float:
        """Walks node's subtree, entered with `weight`, `reach` the chance the walk gets there;
        returns the chance that the path ends in this subtree once it is entered."""
        row = np.asarray(p[node + 1], dtype=np.float64)  # [vocab]
        children = kids[node + 1]
        if not children:  # a leaf: m = w p, so the path ends here with chance w, p's token after
            ends[node + 1], after[node + 1] = reach * weight, row
            return weight
        m, b = weight * row, 1.0 - weight  # [vocab], the mass of "not this node"
        q_i = np.asarray(q[node + 1], dtype=np.float64)  # [vocab]
        kept, left = 0.0, 1.0  # the chance the path ends below; that no child so far was kept
        z = m.sum() + b
        for j, child in enumerate(children):
            x = tree.tokens[child]
            w = min(1.0, m[x] / (z * q_i[x])) if q_i[x] > 0 and z > 0 else 0.0
            below = enter(child, w, reach * left)
            kept += left * below
            left *= 1.0 - below
            if left <= 0.0:
                return kept
            m, b = np.maximum(m / z - q_i, 0.0), b / z
            z = m.sum() + b
            if not replacement and j + 1 < len(children):  # (the last child's q is not needed)
                q_i = q_i.copy()
                q_i[x] = 0.0
                s = q_i.sum()
                q_i = q_i / s if s > 0 else q_i  # every token drafted: no further child can come
        s = z - b
        here = s / z if z > 0 else 1.0  # z = 0: a walk that cannot get here
        ends[node + 1] = reach * left * here
        after[node + 1] = _after_cut(m, row)
        return kept + left * here

    enter(-1, 1.0, 1.0)
    return ends, after


def verify_tree_greedy(target_logits: np.ndarray, tree: DraftTree) -> tuple[list[int], int]:
    """Greedy verification of a tree: from the root, down into the child that holds the target's
    argmax at the node reached, while there is one. target_logits [n + 1, vocab] rows as p in
    verify_tree. Returns (the accepted path's nodes, the argmax after it): plain greedy's tokens."""
    target_logits = np.asarray(target_logits)
    if target_logits.ndim != 2 or target_logits.shape[0] != len(tree.tokens) + 1:
        raise ValueError(
            f"target_logits must be [nodes + 1 = {len(tree.tokens) + 1}, vocab], got {target_logits.shape}"
        )
    best = np.argmax(target_logits, axis=1)  # [n + 1]
    path: list[int] = []
    node = -1
    while True:
        token = int(best[node + 1])
        node = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if node is None:
            return path, token
        path.append(node)


# -- what a rule keeps in expectation ---------------------------------------------------------------
# A sampled step's kept count is a draw; its expectation given the draft and p is not. A benchmark
# that averages these in place of the counts has the same mean with less noise (Rao-Blackwell), and
# can ask what another rule would have kept of the very same draft (benchmarks/verification_rules.py).


def expected_kept(p: np.ndarray, draft_tokens: Sequence[int], q: np.ndarray | None, rule: str = "block") -> float:
    """The draft tokens verify(..., rule) keeps of this chain, in expectation over its draws. Token
    by token: the sum over j of prod_{i <= j} min(1, p_i(x_i) / q_i(x_i)). Block: the sum over n of
    n h[n - 1] prod_{m >= n} (1 - h[m]) (block_weights: prefix n passes, every longer one fails).
    A one-hot q (None) goes token by token under every rule, as verify does ("traversal" is
    "block" on a chain).
    p [k + 1, vocab], q [k, vocab] or None."""
    p = np.asarray(p)
    k = len(draft_tokens)
    _check_chain(p, k, q)
    if k == 0:
        return 0.0
    if CHAIN_RULES.get(rule) == "block" and q is not None:
        _, h = block_weights(p, draft_tokens, q)  # [k]
        later = np.append(np.cumprod((1.0 - h)[::-1])[::-1][1:], 1.0)  # [k] later[n - 1] = prod_{m >= n} (1 - h[m])
        return float(np.sum(np.arange(1, k + 1) * h * later))
    at = (np.arange(k), list(draft_tokens))
    px = p[at]  # [k]
    qx = np.ones(k) if q is None else np.asarray(q)[at]  # [k]
    ratio = np.minimum(1.0, px / np.where(qx > 0, qx, 1.0)) * (qx > 0)  # [k] q == 0 rejects
    return float(np.cumprod(ratio).sum())


def _after_cut(m: np.ndarray, row: np.ndarray) -> np.ndarray:
    """The token after a tree's kept path (tree_block_cuts): norm(m), what is left of the node's
    measure; p's row where nothing is (a cut the walk cannot make)."""
    s = m.sum()
    return m / s if s > 0 else row


def expected_tree_kept(
    p: np.ndarray, tree: DraftTree, q: np.ndarray | None, replacement: bool = True, rule: str = "block"
) -> float:
    """The nodes verify_tree(..., rule) keeps of this tree (its accepted path's length), in
    expectation over its draws. Traversal (q real): each node's depth times the chance the path
    ends there (tree_block_cuts). Block, token (or q None): under each node, each child's chance
    of being the one accepted (min(1, r(x) / q_i(x)) once the siblings before it were rejected,
    verify_candidates' rule) times one plus what its own subtree keeps. p and q as in verify_tree."""
    p = np.asarray(p)
    _check_tree(p, tree, q)
    if TREE_RULES.get(rule) == "traversal" and q is not None:
        ends, _ = tree_block_cuts(p, tree, q, replacement)
        kept = np.concatenate([[0], tree_depths(tree.parents) + 1])  # [n + 1] row i + 1: node i's path
        return float(ends @ kept)

    def kept(node: int) -> float:
        r = np.asarray(p[node + 1], dtype=np.float64)  # [vocab]
        q_i = None if q is None else np.asarray(q[node + 1], dtype=np.float64)  # [vocab]
        total, reach = 0.0, 1.0  # reach: the chance every sibling so far was rejected
        for child in tree.children(node):
            x = tree.tokens[child]
            qx = 1.0 if q_i is None else q_i[x]
            accept = min(1.0, r[x] / qx) if qx > 0 else 0.0
            total += reach * accept * (1.0 + kept(child))
            reach *= 1.0 - accept
            if reach <= 0.0:
                break
            r, q_i = _rejected(r, q_i, x, replacement)
        return total

    return kept(-1)


def position_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """Gumbel noise [vocab] fixed by (seed, position): the same at a position of a generation
    whatever was drafted, cached or batched before it."""
    return np.random.default_rng([seed, position]).gumbel(size=vocab)


def sample_at(p_row: np.ndarray, seed: int, position: int) -> int:
    """A token of p_row [vocab] by the Gumbel-max trick, argmax(log p + g), with the noise g of
    (seed, position): an exact sample of p_row when g is fresh, and the same token every time the
    same (seed, position) meets the same p_row. Zero-probability tokens never win (log 0 = -inf)."""
    noise = position_noise(seed, position, p_row.size)
    kept = np.flatnonzero(p_row)
    if 4 * kept.size < p_row.size:  # a filtered p (top-k, top-p) keeps few: log and compare only those
        return int(kept[np.argmax(np.log(p_row[kept]) + noise[kept])])
    with np.errstate(divide="ignore"):
        return int(np.argmax(np.log(p_row) + noise))


def verify_at(p: np.ndarray, draft_tokens: Sequence[int], seed: int, start: int) -> tuple[int, int]:
    """Position-keyed verification: the token at generation position start + i is
    sample_at(p[i], seed, start + i), what plain decoding with the same seed emits there, so the
    output depends on the seed and the target's probabilities alone, never on the drafts. A draft
    token is kept exactly when it is that token: for a one-hot draft (prompt lookup, the suffix
    cache, a greedy head) with probability p(x), the standard rule's own acceptance; for a draft
    sampled from a real q independently of the noise, with probability sum_x q(x) p(x), below the
    standard rule's sum_x min(p(x), q(x)). Returns (n_accepted, next_token) like verify."""
    p = np.asarray(p)
    k = len(draft_tokens)
    _check_chain(p, k, None)
    for i, x in enumerate(draft_tokens):
        y = sample_at(p[i], seed, start + i)
        if int(x) != y:
            return i, y
    return k, sample_at(p[k], seed, start + k)


def draft_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> tuple[int, np.ndarray | None]:
    """How a model drafter picks its next token from its logits [vocab]: the argmax when greedy
    (no q needed: greedy verification compares tokens), else a sample from q, returned with q
    (processed exactly like the target's p, as lossless verification requires)."""
    if params.greedy:
        return int(np.argmax(logits)), None
    q = logits_to_probs(logits, params)  # [vocab]
    return sample(q, rng), q


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target's own distribution at its position
    (the raw logits: before temperature, top-k, top-p or min-p, as vLLM's default and OpenAI's),
    and the `top` most likely tokens there, most likely first, as (token, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def masked(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Logits rows with the tokens a grammar disallows at -inf (a copy): the constrained target,
    before temperature and the filters (../shared/DESIGN.md's order; grammar.Constraint.masks)."""
    out = np.array(logits, dtype=np.float32, copy=True)
    out[~allowed[: len(out)]] = -np.inf
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p [vocab] of one position's raw logits (temperature 1, no filters), in float64."""
    shifted = logits.astype(np.float64) - float(np.max(logits))
    return shifted - np.log(np.sum(np.exp(shifted)))


def verify_draft(
    logits: np.ndarray,
    tokens: Sequence[int],
    tree: DraftTree | None,
    q: np.ndarray | None,
    params: SamplingParams,
    rng: np.random.Generator,
    rule: str = "block",
    at: tuple[int, int] | None = None,
) -> tuple[list[int], int]:
    """One row's draft verified by the rule its params and the draft's shape call for: the one
    place that picks it.

        a tree, greedy                  verify_tree_greedy
        a tree, sampled                 verify_tree: TREE_RULES[rule], its nodes by their q (drawn
                                        without replacement), else the rule for fixed candidates
        a chain, sampled by position    verify_at (`at` = (seed, position): the token of the seed
                                        and position, whatever q)
        a chain otherwise               verify: greedy by token equality, sampled by CHAIN_RULES[rule]

    logits [len(tokens) + 1, vocab]: row 0 scores the row's last token, row i + 1 the draft's token
    i; a tree's q has a row per node (the distribution it was drawn from). Returns (the indices of
    the draft tokens kept: a tree's path, a chain's first n; the token after them)."""
    if tree is not None:
        if params.greedy:
            return verify_tree_greedy(logits, tree)
        p = logits_to_probs(logits, params)
        return verify_tree(p, tree, q_by_parent(q, tree, p.shape), rng, False, rule)
    if at is not None and not params.greedy:
        n, after = verify_at(logits_to_probs(logits, params), tokens, *at)
    else:
        n, after = verify(logits, tokens, q, params, rng, rule)
    return list(range(n)), after


def q_by_parent(q: np.ndarray | None, tree: DraftTree, shape) -> np.ndarray | None:
    """A sampled tree's q (row i: the distribution node i was drawn from) in verify_tree's rows
    (row j + 1: the distribution node j's children were drawn from; row 0 the roots')."""
    if q is None:
        return None
    out = np.zeros(shape, dtype=q.dtype)
    for node, parent in enumerate(tree.parents):
        out[parent + 1] = q[node]
    return out


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    """TokenLogprob of `token` from one position's logits [vocab]."""
    logp = log_softmax(logits)
    best = ()
    if top:
        ids = np.argpartition(-logp, top - 1)[:top] if top < len(logp) else np.arange(len(logp))
        ids = ids[np.lexsort((ids, -logp[ids]))]  # most likely first; ties by id
        best = tuple((int(i), float(logp[i])) for i in ids)
    return TokenLogprob(int(token), float(logp[token]), best)
