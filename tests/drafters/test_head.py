"""Trained heads (drafters/head.py, train/): the hidden states they read, their math against the
torch modules that train them, greedy identity and the exact sampled distribution through the
engine, and every way a head file can be wrong."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.drafters import headfile
from specdec.drafters.head import HeadDrafter, ProphetChain, medusa_features
from specdec.errors import SpecdecError
from specdec.models.numpy_ref import load_numpy_model
from specdec.spec import DraftSpec, parse

from ..models.test_numpy_ref import write_tiny_gguf
from ..toy import ToyLM, frozen
from .heads import random_head

PROMPT = "the cat in a hat the cat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=3)
    return load_numpy_model(path)


def test_hidden_states_are_what_the_output_head_reads(tiny):
    """keep_hidden: the final-norm states of the tokens a forward returns logits for, cut back by
    a rollback; logits = state @ output.T."""
    tiny.keep_hidden()
    row = tiny.add_rows(1)[0]
    tokens = tiny.tokenizer.encode(PROMPT, add_special=False)
    logits = tiny.forward_rows({row: tokens}, {row: 4})[row]  # [4, vocab]
    first, states = tiny.hidden_rows([row])[row]
    assert first == len(tokens) - 4 and states.shape == (4, tiny.n_embd)
    output = tiny.head_weights("output", np.arange(tiny.vocab_size))
    np.testing.assert_allclose(states @ output.T, logits, rtol=1e-4, atol=1e-4)
    tiny.rollback_rows({row: len(tokens) - 2})
    first, states = tiny.hidden_rows([row])[row]
    assert len(states) == 2  # the two positions still cached
    tiny.forward_rows({row: tokens[-2:]})  # a forward without logits keeps the earlier states
    assert len(tiny.hidden_rows([row])[row][1]) == 2
    tiny.drop_rows([row])


def test_llama_cpp_gives_the_same_hidden_states(tiny):
    """The llama.cpp backend's hidden states (its embeddings output) are the NumPy reference's."""
    from ..conftest import require_module

    require_module("llama_cpp", "make setup")
    from specdec.models.llama_cpp import LlamaCppModel

    model = LlamaCppModel(tiny.path, n_ctx=64)
    model.keep_hidden()
    tiny.keep_hidden()
    tokens = tiny.tokenizer.encode(PROMPT, add_special=False)
    rows = model.add_rows(1), tiny.add_rows(1)
    model.forward_rows({rows[0][0]: tokens}, {rows[0][0]: 3})
    tiny.forward_rows({rows[1][0]: tokens}, {rows[1][0]: 3})
    (a_first, a), (b_first, b) = model.hidden_rows(rows[0])[rows[0][0]], tiny.hidden_rows(rows[1])[rows[1][0]]
    assert a_first == b_first and a.shape == b.shape == (3, tiny.n_embd)
    np.testing.assert_allclose(a, b, atol=1e-2)  # llama.cpp keeps K/V in float16 (test_numpy_ref)
    vocab = np.array([5, 7, 100])
    np.testing.assert_allclose(model.head_weights("output", vocab), tiny.head_weights("output", vocab), atol=1e-6)
    assert model.identity == tiny.identity
    tiny.drop_rows(rows[1])


def test_a_chain_stays_in_float32(tiny, tmp_path):
    """Every feature a head computes is float32, as its weights are: one float64 value (a NumPy
    float64 scalar in the attention's scale did it) makes every later matvec copy its weights to
    float64 first, which made the 1.5B's prophet step 10x slower."""
    from specdec.drafters.head import ProphetChain

    h = np.random.default_rng(0).normal(size=tiny.n_embd).astype(np.float32)
    for kind in ("medusa", "prophet"):
        info, w = headfile.load(random_head(tiny, kind, tmp_path / f"{kind}.head", seed=2))
        if kind == "medusa":
            assert medusa_features(w, h, 3).dtype == np.float32
        else:
            chain, feature = ProphetChain(w, info.n_head), h
            for token in (4, 9, 2):
                feature = chain.step(feature, token)
                assert feature.dtype == np.float32


def test_torch_heads_compute_what_the_drafter_computes(tiny, tmp_path):
    """drafters.head_net (torch, batched) and drafters.head (NumPy, one chain) are the same function."""
    from ..conftest import require_module

    torch = require_module("torch", "pip install torch")
    from specdec.drafters.head_net import Medusa, Prophet, draft, load_head

    rng = np.random.default_rng(1)
    h = rng.normal(size=(2, tiny.n_embd)).astype(np.float32)
    for kind in ("medusa", "prophet"):
        info, w = headfile.load(random_head(tiny, kind, tmp_path / f"{kind}.head", seed=2))
        lm_head = torch.from_numpy(w["lm_head"])
        if kind == "medusa":
            module = Medusa(lm_head, 3)
        else:
            module = Prophet(lm_head, torch.from_numpy(w["embed"][:-1]), 3, info.n_head, info.n_ff)
        load_head(module, w)
        for name, tensor in module.head_tensors().items():
            np.testing.assert_array_equal(tensor.detach().numpy(), w[name])
        tokens = np.array([[4, 9, 2], [7, 7, tiny.vocab_size]])  # embedding rows; the last: any other token
        with torch.no_grad():
            if kind == "medusa":
                want = [x.numpy() for x in module(torch.from_numpy(h))]
            else:
                want = [x.numpy() for x in module(torch.from_numpy(h), torch.from_numpy(tokens))[1]]
        for b in range(2):
            if kind == "medusa":
                got = [w["lm_head"] @ f for f in medusa_features(w, h[b], 3)]
            else:
                chain, feature, got = ProphetChain(w, info.n_head), h[b], []
                for i in range(3):
                    feature = chain.step(feature, tokens[b, i])
                    got.append(w["lm_head"] @ feature)
            for i in range(3):
                np.testing.assert_allclose(got[i], want[i][b], rtol=1e-4, atol=1e-4)
        # greedy drafting in torch (what a GPU drafter runs) chooses what the NumPy drafter chooses
        drafted = draft(module, torch.from_numpy(h), torch.from_numpy(tokens[:, 0]), 3)
        for b in range(2):
            if kind == "medusa":
                want_rows = [int(np.argmax(w["lm_head"] @ f)) for f in medusa_features(w, h[b], 3)]
            else:
                chain, f, row, want_rows = ProphetChain(w, info.n_head), h[b], tokens[b, 0], []
                for _ in range(3):
                    f = chain.step(f, row)
                    row = int(np.argmax(w["lm_head"] @ f))
                    want_rows.append(row)
            assert drafted[b].tolist() == want_rows


@pytest.mark.parametrize("kind", ["medusa", "prophet"])
def test_greedy_with_a_head_is_plain_greedy(tiny, tmp_path, kind):
    head = random_head(tiny, kind, tmp_path / f"{kind}.head")
    config = GenerationConfig(max_new_tokens=40, chat=False)
    plain = SpeculativeDecoder(tiny).generate(PROMPT, config)
    spec = SpeculativeDecoder.from_spec(tiny, parse(f"head:{head}", backend="numpy", k=3)).generate(PROMPT, config)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0
    batch = SpeculativeDecoder.from_spec(tiny, parse(f"head:{head}", k=2)).generate_batch(
        [PROMPT, "a hat"], config
    )  # rows drafting side by side read their own hidden states
    assert batch[0].tokens == plain.tokens
    assert batch[1].tokens == SpeculativeDecoder(tiny).generate("a hat", config).tokens


TREES = [(2, 0), (3, 5)]  # (width, nodes): the chain with leaves, and the five most probable paths


@pytest.mark.parametrize("kind", ["medusa", "prophet"])
@pytest.mark.parametrize("width, nodes", TREES)
def test_a_heads_greedy_tree_is_plain_greedy(tiny, tmp_path, kind, width, nodes):
    """A head's tree, alone and in a batch, writes what plain greedy writes, and keeps more than
    a chain's first branch sometimes (the target takes a sibling)."""
    head = random_head(tiny, kind, tmp_path / f"{kind}.head")
    config = GenerationConfig(max_new_tokens=40, chat=False)
    spec = parse(f"head:{head}", k=3, width=width, nodes=nodes)
    decoder = SpeculativeDecoder.from_spec(tiny, spec)
    assert decoder.drafter.name == f"head:{kind}x{width}" + (f"/{nodes}" if nodes else "")
    plain = SpeculativeDecoder(tiny).generate(PROMPT, config)
    out = decoder.generate(PROMPT, config)
    assert out.tokens == plain.tokens and out.stats.drafted > 0
    # it drafts after a tree too (the kept path's hidden states): plain steps only at the ends
    assert out.stats.decisions.get("plain", 0) <= 2, out.stats.decisions
    batch = decoder.generate_batch([PROMPT, "a hat"], config)
    assert batch[0].tokens == plain.tokens
    assert batch[1].tokens == SpeculativeDecoder(tiny).generate("a hat", config).tokens


def _tree(tiny, tmp_path, kind, width, nodes, params, seed=0):
    head = random_head(tiny, kind, tmp_path / f"{kind}.head", vocab=40, scale=0.3)
    drafter = HeadDrafter(tiny, head, width, nodes)
    h = np.random.default_rng(seed).normal(size=tiny.n_embd).astype(np.float32)
    return drafter, h, drafter._tree(h, 7, 3, params, np.random.default_rng(seed))


def _depths(parents):
    depth = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return depth


def test_a_medusa_tree_offers_each_depths_best_tokens_under_every_node(tiny, tmp_path):
    """Greedy, a medusa head's candidates under any node at a depth are that depth's head's best
    tokens, best first; the shaped tree keeps the budget, parents before children."""
    from specdec.sampling import SamplingParams

    drafter, h, tree = _tree(tiny, tmp_path, "medusa", 3, 6, SamplingParams())
    assert len(tree.tokens) == 6 and tree.q is None
    assert all(parent < i for i, parent in enumerate(tree.parents))
    best = []
    for feature in medusa_features(drafter.w, h, 3):
        logits = drafter.w["lm_head"] @ feature
        best.append(drafter.vocab[np.argsort(-logits, kind="stable")[:3]].tolist())
    depth = _depths(tree.parents)
    for node in [-1, *range(len(tree.tokens))]:
        kids = [i for i, parent in enumerate(tree.parents) if parent == node]
        if kids:
            d = depth[kids[0]]
            assert [tree.tokens[i] for i in kids] == best[d][: len(kids)], node
    assert max(depth) >= 1 and len(set(tree.parents)) > 2  # a tree, not a chain with leaves
    fishbone = _tree(tiny, tmp_path, "medusa", 3, 0, SamplingParams())[2]
    assert fishbone.tokens == [t for row in best for t in row] and fishbone.parents == [-1] * 3 + [0] * 3 + [3] * 3


def test_a_prophets_tree_follows_each_nodes_own_path(tiny, tmp_path):
    """A prophet's children under a node are its best tokens after that node's own path."""
    from specdec.sampling import SamplingParams

    drafter, h, tree = _tree(tiny, tmp_path, "prophet", 2, 6, SamplingParams())
    assert len(tree.tokens) == 6

    def path(node):
        return [] if node < 0 else [*path(tree.parents[node]), node]

    for node in [-1, *range(len(tree.tokens))]:
        kids = [i for i, parent in enumerate(tree.parents) if parent == node]
        if not kids:
            continue
        chain, feature = ProphetChain(drafter.w, drafter.info.n_head), h
        for token in [7, *(tree.tokens[i] for i in path(node))]:
            feature = chain.step(feature, drafter.index[token])
        logits = drafter.w["lm_head"] @ feature
        best = drafter.vocab[np.argsort(-logits, kind="stable")[:2]].tolist()
        assert [tree.tokens[i] for i in kids] == best[: len(kids)], node


@pytest.mark.parametrize("kind", ["medusa", "prophet"])
def test_a_sampled_heads_tree_keeps_the_budget_and_its_draws_q(tiny, tmp_path, kind):
    from specdec.sampling import SamplingParams

    params = SamplingParams(temperature=1.0)
    for seed in range(3):
        _, _, tree = _tree(tiny, tmp_path, kind, 3, 5, params, seed)
        assert len(tree.tokens) == 5 and tree.q.shape == (5, tiny.vocab_size)
        for i, token in enumerate(tree.tokens):
            assert tree.q[i][token] > 0 and abs(tree.q[i].sum() - 1) < 1e-5
        for node in [-1, *range(5)]:  # siblings: distinct draws from one q
            kids = [i for i, parent in enumerate(tree.parents) if parent == node]
            assert len({tree.tokens[i] for i in kids}) == len(kids)
            assert all(np.array_equal(tree.q[i], tree.q[kids[0]]) for i in kids)


def test_a_head_for_another_model_is_refused(tiny, tmp_path):
    head = random_head(tiny, "medusa", tmp_path / "medusa.head")
    other_path = tmp_path / "other.gguf"
    write_tiny_gguf(other_path, "qwen2", seed=4, n_layer=3)
    other = load_numpy_model(other_path)
    with pytest.raises(SpecdecError, match="was trained for .* not other.gguf"):
        HeadDrafter(other, head)
    with pytest.raises(SpecdecError, match="hidden states"):
        HeadDrafter(ToyLM(), head)


def test_broken_head_files_are_refused(tiny, tmp_path):
    with pytest.raises(SpecdecError, match="head file not found"):
        HeadDrafter(tiny, tmp_path / "missing.head")
    junk = tmp_path / "junk.head"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(SpecdecError, match="not a readable head file"):
        HeadDrafter(tiny, junk)
    from safetensors.numpy import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(other))
    with pytest.raises(SpecdecError, match="not a specdec head file"):
        HeadDrafter(tiny, other)
    good = random_head(tiny, "medusa", tmp_path / "good.head")
    truncated = tmp_path / "truncated.head"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(SpecdecError, match="not a readable head file"):
        HeadDrafter(tiny, truncated)


def test_the_spec_names_a_head(tiny, tmp_path):
    path = random_head(tiny, "medusa", tmp_path / "y.head")
    assert parse(f"head:{path}").head == str(path) and parse(f"head:{path}", k=2).k == 2
    with pytest.raises(SpecdecError, match="head:FILE"):
        parse("head:")
    assert parse(f"head:{path}", backend="torch").head == str(path)  # every backend gives hidden states
    with pytest.raises(SpecdecError, match="head file not found"):
        parse(f"head:{tmp_path / 'missing.head'}")
    from specdec.spec import parse_method

    assert parse_method(f"head:3:{path}") == DraftSpec("head", k=3, head=str(path))
    assert parse_method("head:x:y") is None


def test_the_head_file_says_what_it_is(tiny, tmp_path):
    path = random_head(tiny, "prophet", tmp_path / "p.head")
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["specdec"])
    assert meta["kind"] == "prophet" and meta["target_sha256"] == tiny.identity and meta["steps"] == 3


def test_auto_drafts_with_a_head_where_it_pays(tiny, tmp_path):
    """`--draft auto --draft-model head:FILE`: the head takes the draft model's place in auto,
    priced by its own timing and its held-out agreement, and greedy stays plain greedy. On a flat
    target curve (a verify costs what a step does) drafting pays and auto drafts with the head;
    where every draft token doubles a step, it steps aside."""
    from specdec.drafters.head import HeadDrafter

    path = random_head(tiny, "prophet", tmp_path / "p.head")
    spec = parse("auto", draft_model=f"head:{path}")
    assert spec == DraftSpec("auto", k=0, head=str(path))
    config = GenerationConfig(max_new_tokens=40, chat=False)
    plain = SpeculativeDecoder(tiny).generate(PROMPT, config)
    head_curve = HeadDrafter(tiny, path).cost_curve()
    assert head_curve[2] == pytest.approx(2 * head_curve[1]) and head_curve[1] > 0
    flat = {w: 1.0 for w in (1, 2, 4, 8, 16)}
    steep = {w: float(w) ** 2 for w in (1, 2, 4, 8, 16)}
    for curve, drafts in ((flat, True), (steep, False)):
        decoder = SpeculativeDecoder.from_spec(tiny, spec, costs=(frozen(curve), head_curve))
        got = decoder.generate(PROMPT, config)
        assert got.tokens == plain.tokens
        assert (got.stats.drafted > 0) == drafts, got.stats.decisions
        assert isinstance(decoder.model_drafter, HeadDrafter)


def test_a_heads_held_out_agreement_is_autos_prior(tiny, tmp_path):
    """The head file's chain (the share whose first i + 1 guesses all agree) becomes auto's
    per-position acceptance: P(i kept | the ones before kept), 0 past the head's positions."""
    from specdec.acceptance import K_MAX
    from specdec.drafters.head import HeadDrafter

    path = random_head(tiny, "medusa", tmp_path / "m.head")
    head = HeadDrafter(tiny, path)
    assert head.prior is None  # the file measured nothing
    head.info = dataclasses.replace(head.info, held_out={"chain": [0.5, 0.25, 0.1]})
    assert head.prior == pytest.approx([0.5, 0.5, 0.4] + [0.0] * (K_MAX - 3))
    assert head.lag(0, [1, 2, 3]) == 0


def test_serve_gives_auto_the_head(monkeypatch, tmp_path):
    """`specdec serve --draft auto --draft-model head:FILE`: the head is auto's drafter (no draft
    model is loaded) and requests may also name it ('head')."""
    from specdec.cli import build_parser
    from specdec.cli import serve as cli_serve
    from specdec.drafters.head import HeadDrafter
    from specdec.server import app

    from ..conftest import Stopped

    path = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=3)
    head = random_head(load_numpy_model(path), "prophet", tmp_path / "p.head")
    seen = {}

    def stand_in(target, draft, policy, *args, **kwargs):
        seen.update(kwargs, draft=draft, policy=policy, draft_name=args[2])
        raise Stopped

    monkeypatch.setattr(app, "build_service", stand_in)
    argv = ["serve", "--backend", "numpy", "--target", str(path), "--draft", "auto", "--draft-model", f"head:{head}"]
    with pytest.raises(Stopped):
        cli_serve.cmd_serve(build_parser().parse_args(argv))
    assert isinstance(seen["draft"], HeadDrafter) and seen["head"] is seen["draft"]
    assert seen["policy"].is_auto and seen["draft_name"] is None


def test_serve_drafts_a_heads_tree(monkeypatch, tmp_path):
    """`specdec serve --draft head:FILE --draft-width W --draft-nodes N`: the server's head drafts
    that tree shape (the same parse and drafter as generate's); the draft model loaded for auto
    and for requests that name it stays a chain drafter (it once became a tree of that width)."""
    from specdec.cli import build_parser
    from specdec.cli import serve as cli_serve
    from specdec.server import app

    from ..conftest import Stopped

    path = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=3)
    head = random_head(load_numpy_model(path), "medusa", tmp_path / "m.head")
    draft_path = tmp_path / "tiny-draft.gguf"  # the same vocabulary
    write_tiny_gguf(draft_path, "qwen2", seed=4, n_layer=1)
    seen = {}

    def stand_in(target, draft, policy, *args, **kwargs):
        seen.update(kwargs, policy=policy, draft=draft)
        raise Stopped

    monkeypatch.setattr(app, "build_service", stand_in)
    argv = ["serve", "--backend", "numpy", "--target", str(path), "--draft", f"head:{head}"]
    argv += ["--draft-model", str(draft_path)]
    with pytest.raises(Stopped):
        cli_serve.cmd_serve(build_parser().parse_args([*argv, "--draft-width", "2", "--draft-nodes", "3", "-k", "3"]))
    assert isinstance(seen["head"], HeadDrafter) and (seen["head"].width, seen["head"].nodes) == (2, 3)
    assert seen["head"].name == "head:medusax2/3" and seen["policy"].kind == "head"
    assert getattr(seen["draft"], "width", 1) == 1  # the draft model drafts chains


def test_every_tree_drafter_refuses_a_bad_shape(tiny, tmp_path):
    """One check (drafters.base.tree_shape) for a head, a draft model and the suffix cache: a
    width under 1, a negative budget, or a budget without a width of 2 or more."""
    from specdec.drafters.model import ModelDrafter
    from specdec.drafters.suffix import SuffixCacheDrafter

    head = random_head(tiny, "medusa", tmp_path / "m.head")
    makers = (
        lambda width, nodes: HeadDrafter(tiny, head, width, nodes),
        lambda width, nodes: ModelDrafter(ToyLM(), width=width, nodes=nodes),
        lambda width, nodes: SuffixCacheDrafter().shape(width, nodes),
    )
    for width, nodes in ((0, 0), (2, -1), (1, 3)):
        for make in makers:
            with pytest.raises(ValueError, match="a draft tree is width >= 1"):
                make(width, nodes)
    assert HeadDrafter(tiny, head, 3, 5).name == "head:medusax3/5"
