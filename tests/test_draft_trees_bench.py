"""benchmarks/draft_trees.py's step: a draft scored after a row's context, counted as the rule keeps
it, the row left as it was; a tree that is a chain counts as that chain does under the same rule."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from specdec.drafters.base import Draft
from specdec.sampling import SamplingParams, logits_to_probs

from .toy import ToyLM

_spec = importlib.util.spec_from_file_location(
    "draft_trees", Path(__file__).resolve().parents[1] / "benchmarks" / "draft_trees.py"
)
draft_trees = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(draft_trees)


def test_a_chain_shaped_tree_counts_as_its_chain_and_the_row_is_left_as_it_was():
    target = ToyLM(seed=7)
    [row] = target.add_rows(1)
    context = [3, 4, 5, 6]
    target.forward_rows({row: context[:-1]}, {})
    seq, tokens = list(context), []
    for _ in range(5):  # the target's own greedy run, then a miss
        tokens.append(int(np.argmax(target.table[seq[-2], seq[-1]])))
        seq.append(tokens[-1])
    tokens[3] = (tokens[3] + 1) % target.vocab_size
    greedy = SamplingParams()
    chain = draft_trees.step_tokens(target, row, context[-1], Draft(tokens), greedy, "block")
    tree = draft_trees.step_tokens(target, row, context[-1], Draft(tokens, parents=[-1, 0, 1, 2, 3]), greedy, "block")
    assert chain == (4, 6, 4) and tree == (4, 6, 4)  # 3 kept + the target's token; 6 scored
    assert target.row_length(row) == len(context) - 1
    # sampled: a chain drawn from q, under token-by-token verification, and as a tree
    sampled = SamplingParams(temperature=1.0)
    draft = ToyLM(seed=8)
    q, seq = [], list(context)
    for t in tokens:
        q.append(logits_to_probs(draft.table[seq[-2], seq[-1]], sampled))
        seq.append(t)
    q = np.stack(q)
    block, _, by_token = draft_trees.step_tokens(target, row, context[-1], Draft(tokens, q), sampled, "block")
    as_tree, _, _ = draft_trees.step_tokens(
        target, row, context[-1], Draft(tokens, q, parents=[-1, 0, 1, 2, 3]), sampled, "block"
    )
    assert abs(as_tree - by_token) < 1e-9 and 1 <= by_token <= 6 and 1 <= block <= 6
    # under traversal the same chain as a tree is block verification's, its token column node by node's
    walked, _, node_by_node = draft_trees.step_tokens(
        target, row, context[-1], Draft(tokens, q, parents=[-1, 0, 1, 2, 3]), sampled, "traversal"
    )
    assert abs(walked - block) < 1e-9 and abs(node_by_node - by_token) < 1e-9
    assert target.row_length(row) == len(context) - 1


def test_a_method_it_cannot_pair_is_one_line_and_exit_2():
    """Before any model loads: a method that drafts no chain or tree of a drafter's own."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_trees.py"
    proc = subprocess.run([sys.executable, str(script), "--methods", "ngram:4"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--methods takes" in proc.stderr and "Traceback" not in proc.stderr
