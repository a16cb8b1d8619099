"""Tree attention on the llama.cpp backend, on a tiny GGUF written here (tests/models/test_numpy_ref):
one forward scores every node of each row's tree as a chain of its own path would, and keeping a
path leaves the row as that chain's forward would."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import SpecdecError

from ..conftest import require_module
from .test_numpy_ref import TREE_PARENTS, TREE_TOKENS, _tree_path, write_tiny_gguf

require_module("llama_cpp", "make setup")

# llama.cpp keeps K/V in float16 and its kernels depend on the batch's shape: a tree's nodes and
# a chain's tokens agree to this, where a node that saw another branch is off by whole units
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama") / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", n_head_kv=2)
    return path


def _model(path, rows=1):
    from specdec.models.llama_cpp import LlamaCppModel

    return LlamaCppModel(path, n_ctx=128, max_rows=rows, n_threads=1)


def _chain(path, tokens):
    model = _model(path)
    (row,) = model.add_rows(1)
    out = model.forward_rows({row: tokens}, {row: len(tokens)})[row]
    model.close()
    return out


def test_every_node_is_scored_as_its_own_chain(tiny_path):
    model = _model(tiny_path)
    (row,) = model.add_rows(1)
    prefix = model.tokenizer.encode("the cat in")
    model.forward_rows({row: prefix}, {})
    scores = model.forward_tree_rows({row: (TREE_TOKENS, TREE_PARENTS)})[row]
    assert scores.shape == (len(TREE_TOKENS), model.vocab_size)
    assert model.row_length(row) == len(prefix)  # the tree is not the row's until a path is kept
    gaps = []
    for node in range(len(TREE_TOKENS)):
        want = _chain(tiny_path, prefix + [TREE_TOKENS[i] for i in _tree_path(node)])[-1]
        gaps.append(float(np.abs(scores[node] - want).max()))
    assert max(gaps) < TOLERANCE, gaps
    # the power of that: a sibling's logits differ from this node's by far more than the tolerance
    assert np.abs(scores[1] - scores[2]).max() > 50 * TOLERANCE
    model.close()


@pytest.mark.parametrize("leaf", [4, 3, 7])
def test_a_kept_path_continues_as_a_chain(tiny_path, leaf):
    model = _model(tiny_path)
    (row,) = model.add_rows(1)
    prefix, after = model.tokenizer.encode("the cat in"), model.tokenizer.encode(" a hat")
    path = _tree_path(leaf)
    model.forward_rows({row: prefix}, {})
    model.forward_tree_rows({row: (TREE_TOKENS, TREE_PARENTS)})
    model.keep_path_rows({row: path})
    assert model.row_length(row) == len(prefix) + len(path)
    got = model.forward_rows({row: after}, {row: len(after)})[row]
    want = _chain(tiny_path, prefix + [TREE_TOKENS[i] for i in path] + after)[-len(after) :]
    assert np.abs(got - want).max() < TOLERANCE
    from specdec.models.llama_cpp import TREE_SEQS

    assert len(model._tree_free) == TREE_SEQS  # every lent sequence id is back
    model.close()


def test_trees_of_two_rows_in_one_forward(tiny_path):
    model = _model(tiny_path, rows=2)
    a, b = model.add_rows(2)
    prompts = {a: model.tokenizer.encode("the cat"), b: model.tokenizer.encode("then the end in")}
    model.forward_rows(prompts, {})
    scores = model.forward_tree_rows({a: (TREE_TOKENS, TREE_PARENTS), b: (TREE_TOKENS[:3], TREE_PARENTS[:3])})
    assert scores[a].shape[0] == len(TREE_TOKENS) and scores[b].shape[0] == 3
    for row, node in ((a, 7), (b, 2)):
        want = _chain(tiny_path, prompts[row] + [TREE_TOKENS[i] for i in _tree_path(node)])[-1]
        assert np.abs(scores[row][node] - want).max() < TOLERANCE
    model.keep_path_rows({a: [6, 7], b: []})  # b keeps nothing of its tree
    assert model.row_length(a) == len(prompts[a]) + 2 and model.row_length(b) == len(prompts[b])
    want = _chain(tiny_path, prompts[b] + [42])[-1]
    assert np.abs(model.forward_rows({b: [42]}, {b: 1})[b][0] - want).max() < TOLERANCE
    model.close()


def test_a_rollback_or_a_forward_gives_the_trees_sequences_back(tiny_path):
    from specdec.models.llama_cpp import TREE_SEQS

    model = _model(tiny_path)
    (row,) = model.add_rows(1)
    model.forward_rows({row: [1, 2, 3]}, {})
    model.forward_tree_rows({row: (TREE_TOKENS, TREE_PARENTS)})
    assert len(model._tree_free) == TREE_SEQS - 4  # four leaves
    model.rollback_rows({row: 3})
    assert len(model._tree_free) == TREE_SEQS
    with pytest.raises(ValueError, match="no tree"):
        model.keep_path_rows({row: [0]})
    model.forward_tree_rows({row: ([4, 5], [-1, 0])})
    with pytest.raises(ValueError, match="not a path down a tree"):
        model.keep_path_rows({row: [1]})
    model.close()


# The tree in rounds a drafter growing it best first would read it: each round's nodes hang under
# nodes of earlier rounds (drafters.model's growth), numbered on in the order they come
GROWN_ROUNDS = [[0, 6], [1, 7], [2, 4], [3, 5]]


@pytest.mark.parametrize("rows", [1, 2])
def test_a_tree_grown_in_rounds_scores_each_node_as_its_own_chain(tiny_path, rows):
    """grow_tree_rows computes only the new nodes, each as a chain of its own path would (a first
    child goes on down its parent's sequence, a later one takes a copy of the parent's path); a
    path kept of the grown tree continues as a chain, and every lent sequence id comes back."""
    from specdec.models.llama_cpp import TREE_SEQS

    model = _model(tiny_path, rows=rows)
    made = model.add_rows(rows)
    prompts = {row: model.tokenizer.encode("the cat in" if i == 0 else "then a hat") for i, row in enumerate(made)}
    model.forward_rows(prompts, {})
    order: list[int] = []  # the grown tree's node i is TREE_TOKENS' node order[i]
    gaps = []
    for nodes in GROWN_ROUNDS:
        index = {node: i for i, node in enumerate(order)}
        parents = [index.get(TREE_PARENTS[n], -1) for n in nodes]
        out = model.grow_tree_rows({row: ([TREE_TOKENS[n] for n in nodes], parents) for row in made})
        order += nodes
        for row in made:
            assert out[row].shape == (len(nodes), model.vocab_size)
            assert model.row_length(row) == len(prompts[row])  # the tree is not the row's yet
            for node, scores in zip(nodes, out[row]):
                want = _chain(tiny_path, prompts[row] + [TREE_TOKENS[i] for i in _tree_path(node)])[-1]
                gaps.append(float(np.abs(scores - want).max()))
    assert max(gaps) < TOLERANCE, gaps
    # keep the path down to the third child of node 0 (node 3, the copy of a parent's path)
    path = [order.index(n) for n in _tree_path(3)]
    model.keep_path_rows({row: path for row in made})
    after = model.tokenizer.encode(" and")
    for row in made:
        got = model.forward_rows({row: after}, {row: len(after)})[row]
        want = _chain(tiny_path, prompts[row] + [TREE_TOKENS[i] for i in _tree_path(3)] + after)[-len(after) :]
        assert np.abs(got - want).max() < TOLERANCE
    assert len(model._tree_free) == TREE_SEQS
    model.close()


def test_a_grown_tree_may_be_dropped_whole_and_grown_again(tiny_path):
    """Keeping the empty path drops a grown tree (the row is its context again); a forward ends a
    tree in flight; a new growth starts from the row."""
    from specdec.models.llama_cpp import TREE_SEQS

    model = _model(tiny_path)
    (row,) = model.add_rows(1)
    prefix = model.tokenizer.encode("the cat in")
    model.forward_rows({row: prefix}, {})
    model.grow_tree_rows({row: ([5, 9], [-1, -1])})
    model.grow_tree_rows({row: ([17, 23], [0, 0])})
    model.keep_path_rows({row: []})
    assert model.row_length(row) == len(prefix) and len(model._tree_free) == TREE_SEQS
    model.grow_tree_rows({row: ([5], [-1])})
    first = model.grow_tree_rows({row: ([17], [0])})[row][0]
    model.forward_rows({row: [5]}, {})  # ends the tree in flight
    assert len(model._tree_free) == TREE_SEQS
    want = _chain(tiny_path, prefix + [5, 17])[-1]
    assert np.abs(first - want).max() < TOLERANCE
    assert np.abs(model.forward_rows({row: [17]}, {row: 1})[row][0] - want).max() < TOLERANCE
    model.close()


def test_a_growth_past_the_sequence_ids_is_refused_whole(tiny_path):
    """More new branches than sequence ids left: a one-line error before any id is lent, the tree
    in flight as it was (it still keeps a path)."""
    from specdec.models.llama_cpp import TREE_SEQS

    model = _model(tiny_path)
    (row,) = model.add_rows(1)
    model.forward_rows({row: [1, 2, 3]}, {})
    model.grow_tree_rows({row: ([5], [-1])})
    with pytest.raises(SpecdecError, match="more sequence ids"):
        model.grow_tree_rows({row: (list(range(TREE_SEQS)), [-1] * TREE_SEQS)})
    assert len(model._tree_free) == TREE_SEQS - 1
    model.keep_path_rows({row: [0]})
    assert model.row_length(row) == 4 and len(model._tree_free) == TREE_SEQS
    model.close()


def test_trees_past_the_sequence_ids_are_refused_before_any_row_is_touched(tiny_path):
    """Two rows' trees whose leaves together pass the ids left: a one-line error before the first
    row's ids are lent (or its tree in flight given back), every row as it was; the rows' own trees
    in flight count as free, since a new tree gives them back."""
    from specdec.models.llama_cpp import TREE_SEQS

    model = _model(tiny_path, rows=2)
    a, b = model.add_rows(2)
    model.forward_rows({a: [1, 2, 3], b: [4, 5]}, {})
    model.forward_tree_rows({a: ([6, 7], [-1, -1])})  # two leaves in flight on row a
    wide = (list(range(TREE_SEQS)), [-1] * TREE_SEQS)
    with pytest.raises(SpecdecError, match="more leaves"):  # 1 + TREE_SEQS leaves, TREE_SEQS ids
        model.forward_tree_rows({a: ([8], [-1]), b: wide})
    assert len(model._tree_free) == TREE_SEQS - 2  # row a's tree still in flight, nothing lent to b
    model.keep_path_rows({a: [1]})
    assert model.row_length(a) == 4 and len(model._tree_free) == TREE_SEQS
    # exactly as many leaves as ids once row a's own tree comes back: taken
    model.forward_tree_rows({a: ([6, 7], [-1, -1])})
    model.forward_tree_rows({a: ([8], [-1]), b: (list(range(TREE_SEQS - 1)), [-1] * (TREE_SEQS - 1))})
    assert len(model._tree_free) == 0
    model.close()


def test_a_model_of_row_streams_refuses_trees():
    """The exact mode, and a model loaded with trees=False, keep a cache stream per row."""
    from specdec.models.llama_cpp import LlamaCppModel

    model = object.__new__(LlamaCppModel)
    model.exact, model.scores_trees = True, False
    with pytest.raises(SpecdecError, match="keeps one cache stream per row"):
        model.forward_tree_rows({0: ([1], [-1])})


def test_rows_in_streams_of_their_own_score_as_rows_in_one_pool(tiny_path):
    """trees=False (what `specdec serve` loads without tree drafts): every row gets a stream of
    n_ctx cells, scores no trees, and its rows' logits are the pooled model's, step by step, as
    rows join and leave; a row still holds the whole n_ctx."""
    from specdec.models.llama_cpp import LlamaCppModel

    models = [LlamaCppModel(tiny_path, n_ctx=128, max_rows=3, n_threads=1, trees=t) for t in (True, False)]
    assert [m.scores_trees for m in models] == [True, False] and [m.n_ctx for m in models] == [128, 128]
    prompts = [models[0].tokenizer.encode(text) for text in ("the cat", "in a hat", "a")]
    outs = []
    for model in models:
        rows = model.add_rows(3)
        steps = [model.forward_rows(dict(zip(rows, prompts)), {r: 1 for r in rows})]
        model.drop_rows([rows[1]])
        for token in (5, 9, 13):
            steps.append(model.forward_rows({rows[0]: [token], rows[2]: [token, token]}, {rows[0]: 1, rows[2]: 2}))
        (again,) = model.add_rows(1)
        steps.append(model.forward_rows({again: prompts[1], rows[0]: [7]}, {again: 1, rows[0]: 1}))
        assert not model._free  # three rows at most
        model.forward_rows({rows[2]: [3] * (128 - model.row_length(rows[2]))}, {})  # the whole n_ctx
        outs.append([[v for _, v in sorted(step.items())] for step in steps])
        model.close()
    for pooled, streams in zip(*outs):
        for a, b in zip(pooled, streams):
            assert np.abs(a - b).max() < TOLERANCE


def test_rows_in_streams_go_to_llama_cpp_in_seq_id_order(tiny_path):
    """llama.cpp runs a batch over cache streams in one pass only while its seq ids ascend by one
    (split_equal, sequential): given rows in any order, a streams model sends them in seq id
    order and hands each row its own logits; a freed row's id is lent again before higher ones,
    so the ids of live rows stay without gaps."""
    from specdec.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(tiny_path, n_ctx=128, max_rows=4, n_threads=1, trees=False)
    rows = model.add_rows(4)
    assert rows == [0, 1, 2, 3]
    tokens = {3: [5, 6], 1: [7], 0: [9, 10, 11], 2: [4]}
    sent, decode = [], model._decode
    model._decode = lambda items, calls=None: (sent.append([seqs[0] for seqs, *_ in items]), decode(items, calls))[1]
    out = model.forward_rows(tokens, {row: len(t) for row, t in tokens.items()})
    assert sent == [[0, 0, 0, 1, 2, 3, 3]]
    model._decode = decode
    model.rollback_rows({row: 0 for row in rows})
    for row, toks in tokens.items():  # each row alone: the same logits
        alone = model.forward_rows({row: toks}, {row: len(toks)})[row]
        assert np.abs(alone - out[row]).max() < TOLERANCE
    model.drop_rows([2, 0])
    assert model.add_rows(1) == [0] and model.add_rows(1) == [2]
    model.close()


def test_a_kept_stream_answers_a_repeated_prompt_and_a_next_turn_as_a_fresh_row(tiny_path):
    """The engine's prefix cache on llama.cpp's per-row streams (what `specdec serve` loads): a row
    kept after its request, cut back to the start a new prompt shares, then fed the rest, gives
    the greedy tokens of a fresh model."""
    from specdec import GenerationConfig
    from specdec.controller import FixedController
    from specdec.engine import Engine
    from specdec.models.llama_cpp import LlamaCppModel

    def run(engine, prompt):
        request = engine.add(prompt, GenerationConfig(max_new_tokens=12))
        engine.run([request])
        return request

    model = LlamaCppModel(tiny_path, n_ctx=128, max_rows=2, n_threads=1, trees=False)
    assert model.keeps_idle_rows
    engine = Engine(model, FixedController(None, 0), prefix_cache=True)
    prompt = model.tokenizer.encode("the cat in a hat sat on the mat")
    first = run(engine, prompt)
    requests = [run(engine, prompt), run(engine, first.context + prompt[:3]), run(engine, prompt[:4] + [7, 8])]
    assert [r.stats.cached_tokens for r in requests] == [len(prompt) - 1, len(first.context) - 1, 4]
    fresh = LlamaCppModel(tiny_path, n_ctx=128, max_rows=1, n_threads=1, trees=False)
    for r in requests:
        plain = run(Engine(fresh, FixedController(None, 0)), r.prompt_tokens)
        assert r.result.tokens == plain.result.tokens
    model.close()
    fresh.close()


def test_a_streams_cache_copied_to_host_memory_reads_back_into_another_row(tiny_path):
    """save_row / load_row (the engine's host_cache): a row's cells copied out, then read into
    another row (emptied first), which then scores the next tokens as the first row does; a
    conversation whose row went to another prompt reads its history back, and answers as a fresh
    model does."""
    from specdec import GenerationConfig
    from specdec.controller import FixedController
    from specdec.engine import Engine
    from specdec.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(tiny_path, n_ctx=128, max_rows=2, n_threads=1, trees=False)
    a, b = model.add_rows(2)
    prompt = model.tokenizer.encode("the cat in a hat sat on the mat")
    model.forward_rows({a: prompt, b: [5, 6, 7]})
    saved = model.save_row(a)
    assert saved.length == len(prompt) and saved.nbytes > 0
    model.load_row(b, saved)
    assert model.row_length(b) == len(prompt)
    out = model.forward_rows({a: [9, 10], b: [9, 10]}, {a: 2, b: 2})
    assert np.abs(out[a] - out[b]).max() < TOLERANCE
    model.drop_rows([a, b])

    def run(engine, prompt):
        request = engine.add(prompt, GenerationConfig(max_new_tokens=12))
        engine.run([request])
        return request

    engine = Engine(model, FixedController(None, 0), max_rows=1, prefix_cache=True, host_cache=None)
    first = run(engine, prompt)
    run(engine, model.tokenizer.encode("a dog on a log"))  # takes the only row
    turn = first.context + prompt[:3]
    second = run(engine, turn)
    assert second.stats.cached_tokens == len(first.context) - 1
    fresh = LlamaCppModel(tiny_path, n_ctx=128, max_rows=1, n_threads=1, trees=False)
    assert second.result.tokens == run(Engine(fresh, FixedController(None, 0)), turn).result.tokens
    model.close()
    fresh.close()


def test_a_pools_finished_rows_are_copied_out_and_a_next_turn_reads_its_history_back(tiny_path):
    """A pool of cells (trees=True) keeps no idle rows: with host memory the engine copies each
    finished row's cache out as the row goes, and a conversation's next turn, beside another
    request decoding in the pool, reads its history back into a new row and reads only its new
    message, answering as a fresh model does."""
    from specdec import GenerationConfig
    from specdec.controller import FixedController
    from specdec.engine import Engine
    from specdec.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(tiny_path, n_ctx=128, max_rows=2, n_threads=1, trees=True)
    assert not model.keeps_idle_rows
    engine = Engine(model, FixedController(None, 0), prefix_cache=True, host_cache=None)
    prompt = model.tokenizer.encode("the cat in a hat sat on the mat")
    first = engine.add(prompt, GenerationConfig(max_new_tokens=12))
    engine.run([first])
    assert not engine.idle and len(engine.host.entries) == 1
    other = engine.add(model.tokenizer.encode("a dog on a log"), GenerationConfig(max_new_tokens=20))
    engine.step()  # decoding in the pool while the next turn comes
    turn = first.context + prompt[:3]
    second = engine.add(turn, GenerationConfig(max_new_tokens=12))
    engine.run([other, second])
    assert second.stats.cached_tokens == len(first.context) - 1
    fresh = LlamaCppModel(tiny_path, n_ctx=128, max_rows=1, n_threads=1, trees=False)
    for r in (second, other):
        assert r.result.tokens == run_alone(fresh, r), r.prompt_tokens
    model.close()
    fresh.close()


def run_alone(model, request) -> list[int]:
    from specdec import GenerationConfig
    from specdec.controller import FixedController
    from specdec.engine import Engine

    engine = Engine(model, FixedController(None, 0))
    alone = engine.add(request.prompt_tokens, GenerationConfig(max_new_tokens=request.config.max_new_tokens))
    engine.run([alone])
    return alone.result.tokens


def test_a_forward_over_streams_longer_than_a_call_goes_a_pass_a_call(tiny_path):
    """Rows whose tokens pass n_batch go to llama.cpp a pass of equal_splits a llama_decode, the
    passes stream_passes prices (cut into calls of n_batch tokens, llama.cpp would split each call
    again and make more), and every row gets its own logits in its order: the very numbers of
    feeding those passes one forward each."""
    from specdec.models.llama_cpp import LlamaCppModel, equal_splits, stream_passes

    model = LlamaCppModel(tiny_path, n_ctx=128, max_rows=3, n_threads=1, trees=False, n_batch=16)
    rows = model.add_rows(3)
    tokens = {rows[0]: [5 + i % 7 for i in range(20)], rows[1]: [3 + i % 5 for i in range(13)], rows[2]: [9, 4, 8]}
    wanted = {rows[0]: 20, rows[1]: 4, rows[2]: 3}
    fed = {row: len(t) for row, t in tokens.items()}
    widths, decode = [], model._decode
    model._decode = lambda items, calls=None: (widths.append([len(c) for c in calls]), decode(items, calls))[1]
    out = model.forward_rows(tokens, wanted)
    model._decode = decode
    # 3 + 3 + 3, 8 + 8, 2 + 2, 7 (calls of 16 tokens in row order: 16, 4 + 4, 8, 1 + 1, 2)
    assert widths == [stream_passes(fed, 16)] == [[9, 16, 4, 7]]
    model.rollback_rows({row: 0 for row in rows})
    by_pass, at = {row: [] for row in rows}, dict.fromkeys(rows, 0)
    for split in equal_splits(fed, 16):
        feed = {row: tokens[row][at[row] : at[row] + n] for row, n in split}
        keep = {row: max(0, min(n, at[row] + n - (fed[row] - wanted[row]))) for row, n in split}
        got = model.forward_rows(feed, keep)
        for row, n in split:
            by_pass[row] += [got[row]] if keep[row] else []
            at[row] += n
    for row in rows:
        assert np.array_equal(out[row], np.concatenate(by_pass[row]))
    model.close()


def test_the_passes_of_a_forward_over_streams_are_llama_cpps_equal_splits(tiny_path):
    """What the cost model prices (models.llama_cpp.stream_passes, the arithmetic of llama.cpp's
    split_equal over seq ids in order): equal counts from a run of consecutive rows a pass, as one
    llama_decode of the whole forward would split it (forward_rows feeds a longer one a call a
    pass); a pool packs every row into one."""
    from specdec.models.llama_cpp import LlamaCppModel, stream_passes

    assert stream_passes({0: 1, 1: 1, 2: 1, 3: 1}, 512) == [4]
    assert stream_passes({0: 9, 1: 1, 2: 1, 3: 1}, 512) == [4, 8]
    assert stream_passes({3: 1, 0: 1, 1: 1}, 512) == [2, 1]  # a gap at 2: a pass of its own
    assert stream_passes({0: 4, 1: 4, 2: 1, 3: 1}, 512) == [4, 6]
    assert stream_passes({0: 450, 1: 450}, 512) == [512, 388]  # not 450 + 62 a call, then 388: three
    assert stream_passes({0: 330, 2: 330}, 512) == [330, 330]  # not consecutive: a row a pass
    assert stream_passes({0: 1000}, 512) == [512, 488] and stream_passes({}, 512) == []
    streams = LlamaCppModel(tiny_path, n_ctx=128, max_rows=4, n_threads=1, trees=False)
    pool = _model(tiny_path, rows=4)
    assert streams.passes({0: 9, 1: 1, 2: 1, 3: 1}) == [4, 8] and pool.passes({0: 9, 1: 1, 2: 1, 3: 1}) == [12]
    streams.close()
    pool.close()
