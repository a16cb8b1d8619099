"""Trained heads (drafters/head.py, train/): the hidden states they read, their math against the
torch modules that train them, greedy identity and the exact sampled distribution through the
engine, and every way a head file can be wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.drafters.head import HeadDrafter, ProphetChain, medusa_features
from specdec.errors import SpecdecError
from specdec.models.numpy_ref import load_numpy_model
from specdec.spec import DraftSpec, parse
from specdec.train import headfile

from ..models.test_numpy_ref import write_tiny_gguf
from ..toy import ToyLM

PROMPT = "the cat in a hat the cat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=3)
    return load_numpy_model(path)


def random_head(model, kind: str, path, steps: int = 3, seed: int = 0, scale: float = 0.05, vocab: int = 0):
    """A head file of random weights for `model` (what training starts from, plus noise), drafting
    from `vocab` of its tokens (0: all of them)."""
    rng = np.random.default_rng(seed)
    d = model.n_embd
    vocab = rng.permutation(model.vocab_size)[: vocab or model.vocab_size].astype(np.int32)

    def rand(*shape):
        return (rng.normal(size=shape) * scale).astype(np.float16)

    tensors = {"vocab": vocab, "lm_head": model.head_weights("output", vocab).astype(np.float16)}
    n_head = n_ff = 0
    if kind == "medusa":
        for i in range(steps):
            tensors[f"medusa.{i}.weight"], tensors[f"medusa.{i}.bias"] = rand(d, d), rand(d)
    else:
        n_head, n_ff = 4, 16
        fuse = np.concatenate([np.eye(d), np.zeros((d, d))], 1) + rng.normal(size=(d, 2 * d)) * scale
        tensors.update(
            {"fuse.weight": fuse.astype(np.float16), "step": rand(steps, d), "w_down": rand(d, n_ff)},
            embed=np.concatenate([model.head_weights("embedding", vocab), np.zeros((1, d))]).astype(np.float16),
            attn_norm=np.ones(d, np.float16),
            ffn_norm=np.ones(d, np.float16),
            wq=rand(d, d) * 10,
            wk=rand(d, d) * 10,
            wv=rand(d, d) * 10,
            wo=rand(d, d),
            w_gate=rand(n_ff, d) * 10,
            w_up=rand(n_ff, d) * 10,
        )
    info = headfile.HeadInfo(kind, model.identity, model.name, d, model.vocab_size, steps, n_head, n_ff)
    headfile.save(path, info, tensors)
    return path


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


def test_torch_heads_compute_what_the_drafter_computes(tiny, tmp_path):
    """train.modules (torch, batched) and drafters.head (NumPy, one chain) are the same function."""
    from ..conftest import require_module

    torch = require_module("torch", "pip install torch")
    from specdec.train.modules import Medusa, Prophet, load_head

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
    with pytest.raises(SpecdecError, match="needs --backend llama or numpy"):
        parse(f"head:{path}", backend="torch")
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
