"""The torch backend on tiny random models: the cache after rollback is a fresh prefill, a row in
a batch computes what it computes alone, logits only for the rows asked, the tokenizer, loading."""

from __future__ import annotations

import numpy as np
import pytest

from ..conftest import needs_torch

needs_torch()
import torch  # noqa: E402

from specdec.errors import ContextOverflowError, ModelLoadError, SpecdecError  # noqa: E402
from specdec.models.transformers import HFTokenizer, TransformersModel, load_random_weights, load_transformers_model  # noqa: E402

from .. import tiny_hf  # noqa: E402

ATOL = 1e-4  # float32 summation order differs between batch shapes


@pytest.fixture(
    scope="module",
    params=[(arch, "dynamic") for arch in tiny_hf.ARCHS] + [("qwen2", "static"), ("gpt2", "static")],
    ids=lambda p: "-".join(p),
)
def model(request, tokenizer):
    arch, cache = request.param
    target, _ = tiny_hf.pair(arch, len(tokenizer))
    return TransformersModel(target, tokenizer, name=arch, cache=cache)


def full_logits(model, tokens):
    """Logits of every position from one uncached forward: the reference."""
    with torch.no_grad():
        return model.model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu().numpy()


def tokens(seed, n, vocab=320):
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def test_forward_matches_an_uncached_pass(model):
    a, b = tokens(1, 12), tokens(2, 5)
    model.reset()
    assert model.forward(a, n_rows=0).shape == (0, model.vocab_size)
    out = model.forward(b)
    assert out.shape == (5, model.vocab_size) and out.dtype == np.float32
    np.testing.assert_allclose(out, full_logits(model, a + b)[12:], atol=ATOL)
    assert model.n_past == 17


def test_only_the_asked_rows_come_back(model):
    a = tokens(3, 9)
    model.reset()
    last2 = model.forward(a, n_rows=2)
    np.testing.assert_allclose(last2, full_logits(model, a)[-2:], atol=ATOL)


def test_rollback_leaves_the_cache_of_a_fresh_prefill(model):
    """A rejected draft is cut off: keys and values equal a fresh prefill of the kept tokens, and the
    next step gives the logits a fresh model would."""
    a, draft, c = tokens(4, 10), tokens(5, 5), tokens(6, 3)
    model.reset()
    model.forward(a, n_rows=0)
    model.forward(draft)  # verification of a 4-token draft: 5 rows
    model.rollback(12)  # 2 accepted
    kept = model.cached_keys_values()
    fresh = TransformersModel(model.model, model.tokenizer, name="fresh")
    fresh.forward(a + draft[:2], n_rows=0)
    for (k1, v1), (k2, v2) in zip(kept, fresh.cached_keys_values(), strict=True):
        assert k1.shape == k2.shape
        torch.testing.assert_close(k1, k2, atol=ATOL, rtol=0)
        torch.testing.assert_close(v1, v2, atol=ATOL, rtol=0)
    np.testing.assert_allclose(model.forward(c), fresh.forward(c), atol=ATOL)
    np.testing.assert_allclose(model.forward(c[:1]), full_logits(model, a + draft[:2] + c + c[:1])[-1:], atol=ATOL)


def test_rows_of_a_batch_compute_what_they_compute_alone(model):
    prompts = [tokens(7, 3), tokens(8, 11), tokens(9, 1), tokens(10, 20)]
    steps = [tokens(11, 4), [], tokens(12, 1), tokens(13, 2)]
    model.reset()
    rows = model.add_rows(4)
    model.forward_rows(dict(zip(rows, prompts)))
    outs = model.forward_rows(dict(zip(rows, steps)), {r: len(s) for r, s in zip(rows, steps)})
    assert [model.row_length(r) for r in rows] == [7, 11, 2, 22]
    for row, prompt, step in zip(rows, prompts, steps):
        assert outs[row].shape == (len(step), model.vocab_size)
        if step:
            np.testing.assert_allclose(outs[row], full_logits(model, prompt + step)[-len(step) :], atol=ATOL)
    # each row rolls back by its own amount, a finished row leaves, the rest go on
    model.rollback_rows({rows[0]: 5, rows[2]: 1, rows[3]: 21})
    model.drop_rows([rows[1]])
    histories = {
        rows[3]: (prompts[3] + steps[3])[:21],
        rows[0]: (prompts[0] + steps[0])[:5],
        rows[2]: (prompts[2] + steps[2])[:1],
    }
    nexts = {rows[3]: tokens(14, 3), rows[0]: tokens(15, 1), rows[2]: tokens(16, 2)}
    outs = model.forward_rows(nexts, {rows[3]: 1, rows[0]: 1, rows[2]: 2})
    for row, history in histories.items():
        out = outs[row]
        np.testing.assert_allclose(out, full_logits(model, history + nexts[row])[-len(out) :], atol=ATOL)
    # a row joins the running batch and computes what it computes alone; the others are untouched
    [late] = model.add_rows(1)
    late_prompt = tokens(17, 9)
    outs = model.forward_rows({late: late_prompt, rows[0]: [7]}, {late: 2, rows[0]: 1})
    np.testing.assert_allclose(outs[late], full_logits(model, late_prompt)[-2:], atol=ATOL)
    np.testing.assert_allclose(
        outs[rows[0]], full_logits(model, histories[rows[0]] + nexts[rows[0]] + [7])[-1:], atol=ATOL
    )
    model.drop_rows(rows + [late])
    assert model.n_rows == 0


def test_holes_are_compacted_and_results_stay(model):
    """Many rejected drafts leave holes in the shared cache; compaction must not change a row."""
    model.reset()
    rows = model.add_rows(2)
    histories = [tokens(20, 6), tokens(21, 2)]
    model.forward_rows(dict(zip(rows, histories)))
    rng = np.random.default_rng(0)
    for step in range(40):
        drafts = [tokens(100 + step, 6), tokens(200 + step, 1)]
        model.forward_rows(dict(zip(rows, drafts)))
        kept = [int(rng.integers(1, 3)), 1]
        model.rollback_rows({r: len(h) + n for r, h, n in zip(rows, histories, kept)})
        for h, d, n in zip(histories, drafts, kept):
            h.extend(d[:n])
    assert model._valid.shape[1] <= 2 * max(len(h) for h in histories) + 64
    outs = model.forward_rows(dict(zip(rows, [[5], [6]])), {r: 1 for r in rows})
    for row, h, t in zip(rows, histories, [5, 6]):
        np.testing.assert_allclose(outs[row], full_logits(model, h + [t])[-1:], atol=ATOL)
    model.drop_rows(rows)


def test_a_rollback_that_compacts_keeps_every_row(model):
    """One row's long rollback leaves holes under another row's newer columns: the rollback
    compacts (in place on a static cache, whose buffers are inference tensors)."""
    model.reset()
    a, b = model.add_rows(2)
    long, short = tokens(22, 100), tokens(23, 1)
    model.forward_rows({a: long, b: short})
    model.forward_rows({b: [7]})
    width = model._valid.shape[1]
    model.rollback_rows({a: 5})
    assert model._valid.shape[1] < width  # compacted: b's column 100 moved down
    outs = model.forward_rows({a: [5], b: [6]}, {a: 1, b: 1})
    np.testing.assert_allclose(outs[a], full_logits(model, long[:5] + [5])[-1:], atol=ATOL)
    np.testing.assert_allclose(outs[b], full_logits(model, short + [7, 6])[-1:], atol=ATOL)
    model.drop_rows([a, b])


def test_context_overflow_is_an_error(model):
    model.reset()
    with pytest.raises(ContextOverflowError):
        model.forward(tokens(30, model.n_ctx + 1), n_rows=0)


def test_tokenizer_bytes_round_trip(tokenizer):
    tok = HFTokenizer(tokenizer)
    text = "def café(x):\n    return x → 1 🙂"
    ids = tok.encode(text, add_special=False)
    assert b"".join(tok.token_bytes(t) for t in ids).decode() == text
    assert tok.decode(ids) == text
    assert tokenizer.eos_token_id in tok.eog_ids
    assert tok.token_bytes(tokenizer.eos_token_id) == b"<|end|>"
    assert tok.encode("<|end|>", add_special=False) == [tokenizer.eos_token_id]  # a special token's text ...
    assert tokenizer.eos_token_id not in tok.encode("<|end|>", add_special=False, special=False)  # ... as text
    assert tok.token_text(ids[0]) == tokenizer.convert_ids_to_tokens(ids[0])


def test_max_token_bytes_where_the_tokenizer_keeps_every_byte(tokenizer):
    """The bound request.py refuses a long text by before tokenizing it: for a byte-level BPE, the
    longest token's bytes or a special token's spelling; None where the tokenizer may shrink the
    text (Unicode normalization) or swallow whitespace (an added token that strips it)."""
    import copy

    from tokenizers import AddedToken, normalizers

    tok = HFTokenizer(tokenizer)
    longest = tok.max_token_bytes()
    assert longest == max(len(tok.token_bytes(t)) for t in range(len(tokenizer)))  # "<|end|>", 7
    for text in ("<|end|>" * 40, tiny_hf.TEXT, " " * 300, "é" * 100):
        assert len(tok.encode(text)) >= -(-len(text.encode()) // longest), text

    nfc = copy.deepcopy(tokenizer)
    nfc.backend_tokenizer.normalizer = normalizers.NFC()  # "e" + U+0301 (3 bytes) becomes "é" (2)
    assert HFTokenizer(nfc).max_token_bytes() is None
    spaced = copy.deepcopy(tokenizer)
    spaced.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    assert HFTokenizer(spaced).max_token_bytes() is None


def test_loads_a_saved_folder(tmp_path, tokenizer):
    target, _ = tiny_hf.pair("qwen2", len(tokenizer))
    target.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = load_transformers_model(tmp_path, device="cpu", dtype="float32", n_ctx=256)
    assert model.n_ctx == 256 and model.vocab_size == len(tokenizer)
    a = tokens(40, 7)
    np.testing.assert_allclose(model.forward(a, n_rows=1), full_logits(model, a)[-1:], atol=ATOL)
    assert model.tokenizer.decode(model.tokenizer.encode("def add", add_special=False)) == "def add"


def test_load_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_transformers_model(tmp_path / "missing", device="cpu")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_transformers_model(tmp_path, device="cpu")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError):
        load_transformers_model(bad, device="cpu")


def test_a_full_static_cache_compacts_in_place(tokenizer):
    """With a static cache of 2 x 48 columns, rejected drafts fill it fast: the holes are squeezed
    out in place (the buffers keep their addresses) and every row still computes what it would alone."""
    target, _ = tiny_hf.pair("llama", len(tokenizer))
    model = TransformersModel(target, tokenizer, n_ctx=48, cache="static")
    rows = model.add_rows(2)
    histories = [tokens(50, 5), tokens(51, 3)]
    model.forward_rows(dict(zip(rows, histories)))
    buffer = model._layers()[0].keys.data_ptr()
    rng = np.random.default_rng(1)
    for step in range(12):
        drafts = [tokens(300 + step, 5), tokens(400 + step, 2)]
        model.forward_rows(dict(zip(rows, drafts)))
        kept = [int(rng.integers(0, 3)), 1]
        model.rollback_rows({r: len(h) + n for r, h, n in zip(rows, histories, kept)})
        for h, d, n in zip(histories, drafts, kept):
            h.extend(d[:n])
    assert model._layers()[0].keys.data_ptr() == buffer
    outs = model.forward_rows(dict(zip(rows, [[5, 9], [6]])), {r: 1 for r in rows})
    for row, h, t in zip(rows, histories, [[5, 9], [6]]):
        np.testing.assert_allclose(outs[row], full_logits(model, h + t)[-1:], atol=ATOL)


def test_bad_cache_options_are_errors(tokenizer):
    target, _ = tiny_hf.pair("qwen2", len(tokenizer))
    with pytest.raises(SpecdecError, match="unknown cache"):
        TransformersModel(target, tokenizer, cache="paged")
    with pytest.raises(SpecdecError, match="CUDA graphs"):
        TransformersModel(target.cpu(), tokenizer, cache="static", graphs=True)  # on the CPU


def test_random_weights_from_a_config(tmp_path):
    """A model of a config's shape with random weights and a byte tokenizer: what `specdec costs
    --random-weights` times. Same seed, same weights."""
    import json

    config = {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 128,
        "eos_token_id": 299,
        "_source": "a note, ignored",
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config))
    a = load_random_weights(path, device="cpu", dtype="float32", n_ctx=64)
    b = load_random_weights(path, device="cpu", dtype="float32", n_ctx=64, cache="static")
    assert a.vocab_size == 300 and a.n_ctx == 64 and a.name == "tiny (random weights)"
    assert a.tokenizer.eog_ids == {299} and not a.is_instruct
    ids = a.tokenizer.encode("def f(): π")
    assert a.tokenizer.decode(ids) == "def f(): π"
    np.testing.assert_allclose(a.forward(ids), b.forward(ids), atol=ATOL)
    for bad, message in (("{", "not JSON"), ("{}", "model_type")):
        path.write_text(bad)
        with pytest.raises(ModelLoadError, match=message):
            load_random_weights(path, device="cpu")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_random_weights(tmp_path / "missing.json", device="cpu")
