"""Trained heads on the torch backend: its hidden states are what its output head reads (every
architecture and cache layout of the tiny models), kept and cut as llama.cpp's are, and drafting
from them keeps greedy output equal to plain greedy, alone and in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from ..conftest import needs_torch

needs_torch()

from specdec import GenerationConfig, SpeculativeDecoder  # noqa: E402
from specdec.models.transformers import TransformersModel, load_transformers_model  # noqa: E402
from specdec.spec import parse  # noqa: E402

from .. import tiny_hf  # noqa: E402
from .heads import random_head  # noqa: E402


@pytest.fixture(scope="module", params=tiny_hf.CASES, ids=lambda p: "-".join(p))
def model(request, tokenizer):
    arch, layout = request.param
    target, _ = tiny_hf.pair(arch, len(tokenizer))
    return tiny_hf.wrap(target, tokenizer, arch, layout)


def test_hidden_states_are_what_the_output_head_reads(model):
    """The final norm's output for the tokens a forward returns logits for, per row; cut by a
    rollback, untouched by a forward without logits, gone with the row."""
    model.keep_hidden()
    a, b = model.add_rows(2)
    tokens = model.tokenizer.encode("def add(a, b):\n    return a + b", add_special=False)
    logits = model.forward_rows({a: tokens, b: tokens[:5]}, {a: 4, b: 2})
    output = model.head_weights("output", np.arange(model.vocab_size))
    for row, n, length in ((a, 4, len(tokens)), (b, 2, 5)):
        first, states = model.hidden_rows([row])[row]
        assert first == length - n and states.shape == (n, model.n_embd)
        np.testing.assert_allclose(states @ output.T, logits[row], rtol=1e-3, atol=1e-3)
    model.rollback_rows({a: len(tokens) - 2})
    assert len(model.hidden_rows([a])[a][1]) == 2  # the two positions still cached
    model.forward_rows({a: tokens[-2:]})  # no logits asked: the earlier states stay
    assert len(model.hidden_rows([a])[a][1]) == 2
    model.drop_rows([a])
    assert model.hidden_rows([b])[b][1].shape == (2, model.n_embd)
    model.drop_rows([b])
    embedding = model.head_weights("embedding", np.array([3, 5]))
    assert embedding.shape == (2, model.n_embd) and embedding.dtype == np.float32


@pytest.mark.parametrize(
    "kind", ["medusa", "prophet", "medusa tree", "prophet tree", "medusa fishbone", "prophet fishbone"]
)
def test_greedy_with_a_head_is_plain_greedy(model, tmp_path, kind):
    """Chains, and trees scored by torch's tree attention, the kept path's states read at the next
    step: 3x2/4 (the host's NumPy tree) and 3x2 (the fishbone drafted on the device)."""
    kind, _, tree = kind.partition(" ")
    head = random_head(model, kind, tmp_path / f"{kind}.head", scale=0.02)
    config = GenerationConfig(max_new_tokens=32, chat=False)
    prompts = ["def add(a, b):\n", "The quick brown"]
    plain = [SpeculativeDecoder(model).generate(p, config).tokens for p in prompts]
    shape = {"tree": {"width": 2, "nodes": 4}, "fishbone": {"width": 2}}.get(tree, {})
    spec = SpeculativeDecoder.from_spec(model, parse(f"head:{head}", backend="torch", k=3, **shape))
    alone = spec.generate(prompts[0], config)
    assert alone.tokens == plain[0] and alone.stats.drafted > 0
    batch = spec.generate_batch(prompts, config)  # rows drafting side by side read their own states
    assert [r.tokens for r in batch] == plain


@pytest.mark.parametrize("kind", ["medusa", "prophet"])
@pytest.mark.parametrize("width", [2, 3])
def test_a_greedy_fishbone_on_the_device_is_the_hosts_tree(model, tmp_path, kind, width):
    """A greedy k x w tree is drafted on the target's device for all rows at once; it is the tree
    the host builds node by node from the same states (the chain of each step's best, the next
    w - 1 beside each of its nodes), at every row's own depth."""
    from specdec.drafters.head import HeadDrafter
    from specdec.sampling import SamplingParams

    head = HeadDrafter(model, random_head(model, kind, tmp_path / f"{kind}.head", scale=0.5), width=width)
    assert head._torch is not None
    rng = np.random.default_rng(3)
    todo = {
        row: (rng.standard_normal(model.n_embd).astype(np.float32), int(rng.integers(model.vocab_size)), k)
        for row, k in ((0, 3), (1, 1), (2, 2))
    }
    greedy = {row: (SamplingParams(), rng) for row in todo}
    head._tree = lambda *args: pytest.fail("a greedy fishbone was drafted on the host")
    on_device = head._draft_rows(todo, greedy)
    del head._tree  # the host's own, to compare with
    for row, (h, last, k) in todo.items():
        on_host = head._tree(h, last, k, *greedy[row])
        assert on_device[row].tokens == on_host.tokens and on_device[row].parents == on_host.parents
        assert on_device[row].q is None and len(on_host.tokens) == k * width


def test_a_head_arriving_after_plain_steps_keeps_greedy_plain(tmp_path, tokenizer):
    """keep_hidden on a model that has already run (on a GPU: its CUDA graphs captured without the
    hook) captures them again, with their memory pool, and drafting from then on stays exact."""
    layout = tiny_hf.LAYOUTS[-1]
    target, _ = tiny_hf.pair("qwen2", len(tokenizer))
    model = TransformersModel(target, tokenizer, name="qwen2", cache=layout.split("+")[0], graphs="graphs" in layout)
    config = GenerationConfig(max_new_tokens=24, chat=False)
    plain = SpeculativeDecoder(model).generate("def add(a, b):\n", config).tokens
    head = random_head(model, "prophet", tmp_path / "prophet.head", scale=0.02)
    spec = SpeculativeDecoder.from_spec(model, parse(f"head:{head}", backend="torch", k=3))
    drafted = spec.generate("def add(a, b):\n", config)
    assert drafted.tokens == plain and drafted.stats.drafted > 0
    assert SpeculativeDecoder(model).generate("def add(a, b):\n", config).tokens == plain


def test_a_folder_is_named_by_its_weights(tmp_path, tokenizer):
    """A head names its target by the weights: the same folder twice is the same model, another
    model's weights are not (a GGUF is named by its sha256, as the llama.cpp backend names it)."""
    for name, seed in (("one", 0), ("two", 1)):
        target, _ = tiny_hf.pair("qwen2", len(tokenizer), seed=seed)
        target.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    one, again, two = (load_transformers_model(tmp_path / n, device="cpu") for n in ("one", "one", "two"))
    assert one.identity == again.identity != two.identity
    assert len(one.identity) == 64
