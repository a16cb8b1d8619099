"""Tree drafts through the engine: a drafter proposes a tree, the target scores every node in one
forward (NumPy and llama.cpp on tiny GGUF models, torch on tiny random ones), verification walks
down it, and the kept path's cache is the row's. Greedy output is plain greedy output; a row sampled
by position, or a target that scores no trees, verifies the tree's first branch instead."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.drafters.base import Declared, Draft

from . import tiny_hf
from .conftest import require_module

CONFIG = GenerationConfig(max_new_tokens=24, chat=False)
PROMPT = "the cat in a hat"


class OracleTree(Declared):
    """Three-node branches under the row's last token: first a wrong one, then the target's own
    greedy continuation (known in advance), so the first branch never holds and the tree's second
    does. Its second node also has a wrong sibling."""

    name = kind = "oracle-tree"
    takes = frozenset()

    def __init__(self, plain_tokens, prompt_len, vocab):
        self.plain, self.prompt_len, self.vocab = plain_tokens, prompt_len, vocab

    def begin(self, row, prompt, params, rng):
        pass

    def end(self, rows):
        pass

    def accept(self, n_accepted):
        pass

    def propose(self, contexts, ks, leaves=None):
        out = {}
        for row, context in contexts.items():
            at = len(context) - self.prompt_len
            right = self.plain[at : at + 3]
            if not right:
                out[row] = Draft([])
                continue
            wrong = [(t + 1) % self.vocab for t in right]
            tokens = [*wrong, *right, wrong[1 % len(wrong)]]
            parents = [-1, *range(len(wrong) - 1)]
            parents += [-1, *range(len(wrong), len(wrong) + len(right) - 1)]
            parents.append(len(wrong))  # a sibling of the right branch's second node
            out[row] = Draft(tokens[: len(parents)], None, {}, parents)
        return out


def _target(backend, tmp_path):
    if backend.startswith("torch"):  # torch-dynamic, torch-static
        from .conftest import needs_torch

        needs_torch()
        from specdec.models.transformers import TransformersModel

        tokenizer = tiny_hf.tokenizer()
        target, _ = tiny_hf.pair("qwen2", len(tokenizer))
        layout = backend.split("-")[1]
        return TransformersModel(
            target, tokenizer, name="tiny", n_ctx=256, cache=layout.split("+")[0], graphs="graphs" in layout
        )
    from .models.test_numpy_ref import write_tiny_gguf  # needs gguf (the torch rows do not)

    path = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", n_head_kv=2, n_ctx=256)
    if backend == "llama":
        require_module("llama_cpp", "make setup")
        from specdec.models.llama_cpp import LlamaCppModel

        return LlamaCppModel(path, n_ctx=256, max_rows=4, n_threads=1)
    from specdec.models.numpy_ref import load_numpy_model

    return load_numpy_model(path, n_ctx=256)


@pytest.mark.parametrize("backend", ["numpy", "llama", *(f"torch-{layout}" for layout in tiny_hf.LAYOUTS)])
def test_a_greedy_tree_keeps_the_right_branch_and_writes_plain_greedy(tmp_path, backend):
    target = _target(backend, tmp_path)
    plain = SpeculativeDecoder(target, None).generate(PROMPT, CONFIG)
    prompt_len = len(target.tokenizer.encode(PROMPT))
    tree = SpeculativeDecoder(target, OracleTree(plain.tokens, prompt_len, target.vocab_size), k=8)
    out = tree.generate(PROMPT, CONFIG)
    assert out.tokens == plain.tokens
    # three right nodes kept a step: the first branch alone (all wrong) would keep none
    assert out.stats.accepted >= 3 * (out.stats.steps - 2) > 0, out.stats
    batch = tree.generate_batch([PROMPT, PROMPT + " then"], CONFIG)
    assert batch[0].tokens == plain.tokens


def test_without_trees_the_first_branch_is_verified(tmp_path):
    target = _target("numpy", tmp_path)
    plain = SpeculativeDecoder(target, None).generate(PROMPT, CONFIG)
    prompt_len = len(target.tokenizer.encode(PROMPT))
    type(target).scores_trees = False
    try:
        out = SpeculativeDecoder(target, OracleTree(plain.tokens, prompt_len, target.vocab_size), k=8).generate(
            PROMPT, CONFIG
        )
    finally:
        type(target).scores_trees = True
    assert out.tokens == plain.tokens and out.stats.accepted == 0


def test_sampled_by_position_a_tree_row_writes_plains_text(tmp_path):
    target = _target("numpy", tmp_path)
    sampled = replace(CONFIG, temperature=0.8, reproducible=True)
    plain = SpeculativeDecoder(target, None).generate(PROMPT, sampled, seed=3)
    prompt_len = len(target.tokenizer.encode(PROMPT))
    out = SpeculativeDecoder(target, OracleTree(plain.tokens, prompt_len, target.vocab_size), k=8).generate(
        PROMPT, sampled, seed=3
    )
    assert out.tokens == plain.tokens


def test_a_sampled_tree_runs_and_keeps_nodes(tmp_path):
    """Nearly greedy sampling (the oracle knows greedy's text only): the rule for fixed candidates
    keeps the right branch's nodes. Its distribution is tests/test_verify_rules.py's to prove."""
    target = _target("numpy", tmp_path)
    sampled = replace(CONFIG, temperature=0.01)
    greedy = SpeculativeDecoder(target, None).generate(PROMPT, CONFIG)
    prompt_len = len(target.tokenizer.encode(PROMPT))
    out = SpeculativeDecoder(target, OracleTree(greedy.tokens, prompt_len, target.vocab_size), k=8).generate(
        PROMPT, sampled, seed=1
    )
    assert len(out.tokens) == CONFIG.max_new_tokens and out.stats.accepted > 0


def test_a_tree_draft_is_cut_at_stops_and_outside_the_vocabulary():
    d = Draft([5, 6, 7, 8, 9, 99], None, {}, [-1, 0, 1, -1, 3, 3])
    cut = d.upto({6}, vocab_size=50)  # 6 is a stop: 7 goes; 99 is outside: it goes
    assert (cut.tokens, cut.parents) == ([5, 6, 8, 9], [-1, 0, -1, 2])
    assert d.first_branch().tokens == [5, 6, 7] and d.first_branch().parents is None
    assert Draft([1, 2]).first_branch().tokens == [1, 2]
    assert np.array_equal(d.upto(set()).tokens, d.tokens)


@pytest.mark.parametrize("backend", ["numpy", "llama", *(f"torch-{layout}" for layout in tiny_hf.LAYOUTS)])
def test_a_draft_models_greedy_tree_writes_plain_greedy(tmp_path, backend):
    """The draft model's tree (drafters.model, width 3: its top 3 at each depth) through the engine:
    plain greedy's text, alone and in a batch, with more tokens a step than its chain keeps."""
    from specdec.drafters.model import ModelDrafter

    target = _target(backend, tmp_path)
    if backend.startswith("torch"):
        from specdec.models.transformers import TransformersModel

        draft = TransformersModel(tiny_hf.pair("qwen2", target.vocab_size)[1], target.tokenizer, name="d", n_ctx=256)
    else:
        from .models.test_numpy_ref import write_tiny_gguf

        write_tiny_gguf(tmp_path / "draft.gguf", "qwen2", seed=1, n_head_kv=2, n_ctx=256)
        if backend == "llama":  # a llama.cpp draft grows its trees in place (grow_tree_rows)
            from specdec.models.llama_cpp import LlamaCppModel

            draft = LlamaCppModel(tmp_path / "draft.gguf", n_ctx=256, max_rows=4, n_threads=1)
        else:  # the NumPy draft scores its tree so far again each round
            from specdec.models.numpy_ref import load_numpy_model

            draft = load_numpy_model(tmp_path / "draft.gguf", n_ctx=256)
    config = replace(CONFIG, max_new_tokens=40)
    plain = SpeculativeDecoder(target, None).generate(PROMPT, config)
    chain = SpeculativeDecoder(target, ModelDrafter(draft), k=4).generate(PROMPT, config)
    tree_decoder = SpeculativeDecoder(target, ModelDrafter(draft, width=3), k=4)
    tree = tree_decoder.generate(PROMPT, config)
    assert tree.tokens == chain.tokens == plain.tokens
    assert tree.stats.drafted > chain.stats.drafted  # siblings were drafted
    assert tree.stats.generated_tokens / tree.stats.steps >= chain.stats.generated_tokens / chain.stats.steps
    batch = tree_decoder.generate_batch([PROMPT, PROMPT + " then"], config)
    assert batch[0].tokens == plain.tokens
    # grown best first by the draft's path probabilities (EAGLE-2's tree): 4 nodes a step, 4 deep at most
    shaped_decoder = SpeculativeDecoder(target, ModelDrafter(draft, width=3, nodes=4), k=4)
    shaped = shaped_decoder.generate(PROMPT, config)
    assert shaped.tokens == plain.tokens
    assert 0 < shaped.stats.drafted <= 4 * shaped.stats.steps
    batch = shaped_decoder.generate_batch([PROMPT, PROMPT + " then"], config)
    assert batch[0].tokens == plain.tokens


@pytest.mark.parametrize("backend", ["numpy", *(f"torch-{layout}" for layout in tiny_hf.LAYOUTS)])
def test_an_early_exits_greedy_tree_writes_plain_greedy(tmp_path, backend):
    """The early exit's tree (drafters.model.Levels through the target's own cache: the exit's top 2
    at each depth, or the 4 likeliest paths of its top 3) through the engine: plain greedy's text,
    alone and in a batch, with siblings scored and at least its chain's tokens a step."""
    from specdec.drafters.early_exit import EarlyExitDrafter

    target = _target(backend, tmp_path)
    config = replace(CONFIG, max_new_tokens=40)
    plain = SpeculativeDecoder(target, None).generate(PROMPT, config)
    chain = SpeculativeDecoder(target, EarlyExitDrafter(target, 1), k=4).generate(PROMPT, config)
    tree_decoder = SpeculativeDecoder(target, EarlyExitDrafter(target, 1, width=2), k=4)
    tree = tree_decoder.generate(PROMPT, config)
    assert tree.tokens == chain.tokens == plain.tokens
    assert tree.stats.drafted == 2 * sum(tree.stats.drafted_at) > 0  # every depth: its token and a sibling
    assert tree.stats.generated_tokens / tree.stats.steps >= chain.stats.generated_tokens / chain.stats.steps
    batch = tree_decoder.generate_batch([PROMPT, PROMPT + " then"], config)
    assert batch[0].tokens == plain.tokens
    shaped_decoder = SpeculativeDecoder(target, EarlyExitDrafter(target, 1, width=3, nodes=4), k=4)
    assert shaped_decoder.drafter.name == "early-exit:1x3/4"
    shaped = shaped_decoder.generate(PROMPT, config)
    assert shaped.tokens == plain.tokens
    assert 0 < shaped.stats.drafted <= 4 * shaped.stats.steps
    batch = shaped_decoder.generate_batch([PROMPT, PROMPT + " then"], config)
    then = SpeculativeDecoder(target, None).generate(PROMPT + " then", config).tokens
    assert [r.tokens for r in batch] == [plain.tokens, then]


def test_a_sampled_trees_q_follows_its_nodes():
    """A sampled tree's q rows go with their nodes through pruning; a node outside the vocabulary
    leaves the tree's first branch (its later siblings were drawn without it, so their q rows
    would no longer say how)."""
    q = np.eye(6)[[1, 2, 3, 4, 5]]  # node i's q row: one-hot on i + 1, to follow them
    d = Draft([1, 2, 3, 4, 5], q, {}, [-1, -1, 0, 0, 2])
    stopped = d.upto({3})  # node 2 is a stop: node 4 goes
    assert stopped.parents == [-1, -1, 0, 0] and np.array_equal(stopped.q, q[:4])
    first = d.first_branch()
    assert first.tokens == [1, 3, 5] and np.array_equal(first.q, q[[0, 2, 4]])
    outside = d.upto(set(), vocab_size=5)  # node 4 (token 5) is outside: the first branch, cut
    assert outside.parents is None and outside.tokens == [1, 3] and np.array_equal(outside.q, q[[0, 2]])


def test_a_tree_with_more_leaves_than_llama_cpp_lends_goes_as_its_first_branch(tmp_path):
    """llama.cpp lends one sequence id per leaf (TREE_SEQS in all): a step whose trees want more
    verifies the rest as chains, and the text is still plain greedy's."""
    from specdec.drafters.model import ModelDrafter
    from specdec.models.numpy_ref import load_numpy_model

    from .models.test_numpy_ref import write_tiny_gguf

    target = _target("llama", tmp_path)
    write_tiny_gguf(tmp_path / "draft.gguf", "qwen2", seed=1, n_head_kv=2, n_ctx=256)
    draft = load_numpy_model(tmp_path / "draft.gguf", n_ctx=256)
    plain = SpeculativeDecoder(target, None).generate(PROMPT, CONFIG)
    wide = SpeculativeDecoder(target, ModelDrafter(draft, width=8), k=12)  # 12 x 7 + 1 = 85 leaves
    assert target.tree_leaves < 85
    out = wide.generate(PROMPT, CONFIG)
    assert out.tokens == plain.tokens and out.stats.drafted > 0
    assert target.tree_leaves == len(target._tree_free)  # nothing lent is left behind


@pytest.mark.parametrize("backend", ["numpy", "llama", *(f"torch-{layout}" for layout in tiny_hf.LAYOUTS)])
def test_the_kept_path_keeps_its_nodes_hidden_states(tmp_path, backend):
    """A trained head drafts from the state of the row's last cached token: after a tree, the
    kept path's states sit at the positions the path now holds (each the state whose logits the
    tree gave that node), so a head drafts again at the next step."""
    target = _target(backend, tmp_path)
    target.keep_hidden()
    tokens = target.tokenizer.encode(PROMPT)
    row = target.add_rows(1)[0]
    target.forward_rows({row: tokens[:-1]}, {row: 1})
    logits = target.forward_tree_rows({row: ([tokens[-1], 5, 17, 99, 3], [-1, 0, 0, 2, 0])})[row]
    target.keep_path_rows({row: [0, 2, 3]})
    first, states = target.hidden_rows([row])[row]
    assert (first, len(states)) == (len(tokens) - 1, 3)  # the root, then nodes 2 and 3
    output = target.head_weights("output", np.arange(target.vocab_size))
    np.testing.assert_allclose(states @ output.T, logits[[0, 2, 3]], rtol=1e-3, atol=1e-3)
    target.drop_rows([row])
