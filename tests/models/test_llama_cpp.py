"""The llama.cpp backend on the real built-in models."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.errors import ContextOverflowError, ModelLoadError, ModelNotFoundError

pytestmark = pytest.mark.real_models


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# llama.cpp's CPU kernels depend on the batch shape: the same tokens fed as one batch or split in
# two give log-probabilities that differ by up to ~0.35 (measured on the 1.5B), with the same argmax.
# So a comparison across batch shapes gets that tolerance, and exactness is tested with equal shapes.
BATCH_SHAPE_TOLERANCE = 0.5


def test_rollback_reproduces_the_logits(target_model):
    """forward(a + b), rollback(len(a)), forward(b) gives b's logits again."""
    tok = target_model.tokenizer
    a = tok.encode("def add(x, y):\n    return")
    b = tok.encode(" x + y\n\nprint(add(2, 3))")
    target_model.reset()
    first = target_model.forward(a + b)[len(a) :]  # [len(b), vocab]
    target_model.rollback(len(a))
    assert target_model.n_past == len(a)
    again = target_model.forward(b)  # [len(b), vocab]
    assert target_model.n_past == len(a) + len(b)
    np.testing.assert_array_equal(first.argmax(-1), again.argmax(-1))
    assert np.abs(log_softmax(first) - log_softmax(again)).max() < BATCH_SHAPE_TOLERANCE


def test_rolled_back_tokens_leave_no_trace(target_model):
    """Two different rejected drafts of the same length, rolled back, leave bit-identical caches."""
    tok = target_model.tokenizer
    kept = tok.encode("for i in range(10):\n    print(")
    tail = tok.encode("i)")

    def after_rejecting(draft):
        target_model.reset()
        target_model.forward(kept + draft, n_rows=0)
        target_model.rollback(len(kept))
        return target_model.forward(tail)

    one, other = after_rejecting([11, 22, 33, 44]), after_rejecting([555, 666, 777, 888])
    np.testing.assert_array_equal(one, other)
    target_model.reset()
    target_model.forward(kept, n_rows=0)
    fresh = target_model.forward(tail)
    np.testing.assert_array_equal(one.argmax(-1), fresh.argmax(-1))
    assert np.abs(log_softmax(one) - log_softmax(fresh)).max() < BATCH_SHAPE_TOLERANCE


def test_only_the_asked_rows_come_back(target_model):
    tokens = target_model.tokenizer.encode("import numpy as np\nx = np.zeros(3)")
    target_model.reset()
    full = target_model.forward(tokens)
    target_model.reset()
    last2 = target_model.forward(tokens, n_rows=2)
    assert last2.shape == (2, target_model.vocab_size)
    np.testing.assert_allclose(last2, full[-2:], atol=1e-3)
    target_model.reset()
    assert target_model.forward(tokens, n_rows=0).shape == (0, target_model.vocab_size)
    assert target_model.n_past == len(tokens)


def test_tokenizer_round_trip_and_end_tokens(target_model):
    tok = target_model.tokenizer
    text = "naïve café: λx → x² 🚀"
    assert tok.decode(tok.encode(text, add_special=False)) == text
    eog_texts = {tok.token_text(t) for t in tok.eog_ids}
    assert {"<|im_end|>", "<|endoftext|>"} <= eog_texts
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
    # the GGUF's Jinja template, as llama-server and transformers render it: Qwen's default system
    # message where the request has none (llama.cpp's built-in ChatML left it out)
    assert chat.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert target_model.is_instruct
    end = tok.encode("<|im_end|>", add_special=False)  # a special token's text: the token ...
    assert len(end) == 1 and end[0] in tok.eog_ids
    as_text = tok.encode("<|im_end|>", add_special=False, special=False)  # ... or, as text, characters
    assert len(as_text) > 1 and not set(as_text) & tok.eog_ids and tok.decode(as_text) == "<|im_end|>"


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma-3-270m"])
def test_no_token_stands_for_more_bytes_than_max_token_bytes(name):
    """The bound request.py refuses a long text by before tokenizing it, for a byte-level BPE
    (Qwen) and a SentencePiece vocabulary (Gemma): the longest token's print (their special
    tokens' spellings are shorter), worked out without printing every token; no text comes to
    fewer tokens than its bytes over it."""
    from ..conftest import _real_model

    model = _real_model(name)  # kept: the tokenizer reads the model's vocabulary
    tok = model.tokenizer
    longest = tok.max_token_bytes()
    assert longest == max(len(tok.token_bytes(t)) for t in range(tok.n_vocab))
    widest = max(range(tok.n_vocab), key=lambda t: len(tok.token_bytes(t)))
    texts = [tok.token_bytes(widest).decode("utf-8", "replace") * 20, "<|im_end|><end_of_turn>" * 40]
    texts += [" " * 3000, "naïve café: λx → x² 🚀 " * 50, "\n\n\t" * 300]
    for text in texts:
        assert len(tok.encode(text)) >= -(-len(text.encode()) // longest), text[:40]


def test_context_overflow_is_a_clear_error(target_model):
    target_model.reset()
    with pytest.raises(ContextOverflowError, match="--ctx"):
        target_model.forward([42] * (target_model.n_ctx + 1), n_rows=0)
    target_model.reset()


def test_bad_files_are_clear_errors(tmp_path, draft_model):
    from specdec.models.llama_cpp import LlamaCppModel

    with pytest.raises(ModelNotFoundError, match="not found"):
        LlamaCppModel(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        LlamaCppModel(not_gguf)
    truncated = tmp_path / "truncated.gguf"
    with open(draft_model.path, "rb") as src:
        truncated.write_bytes(src.read(4 << 20))
    with pytest.raises(ModelLoadError, match="corrupt, truncated"):
        LlamaCppModel(truncated)


def test_a_draft_of_another_family_drafts_across_tokenizers(target_model):
    """Its token ids alone are refused (ModelDrafter); SpeculativeDecoder takes it string-level."""
    from specdec import SpeculativeDecoder
    from specdec.drafters.cross_vocab import CrossVocabDrafter
    from specdec.drafters.model import ModelDrafter
    from specdec.errors import VocabMismatchError

    from ..conftest import _real_model

    gemma = _real_model("gemma-3-270m")
    with pytest.raises(VocabMismatchError, match="262144 tokens"):
        ModelDrafter(gemma, target_model)
    drafter = SpeculativeDecoder(target_model, gemma).drafter
    assert isinstance(drafter, CrossVocabDrafter) and drafter.mode == "string"


def test_rows_in_one_batch_compute_what_they_compute_alone():
    """Three sequences of one context, advanced in one llama_decode, against each alone; per-row
    rollback; a dropped row's sequence is reused clean; one row too many is a clear error."""
    from specdec import load_model
    from specdec.errors import SpecdecError

    model = load_model("qwen2.5-coder-0.5b", n_ctx=512, max_rows=3, progress=False)
    tok = model.tokenizer
    prompts = [tok.encode(t) for t in ("def add(a, b):", "The capital of France is", "1, 2, 3, 4,")]
    steps = [tok.encode(" return"), tok.encode(" Paris"), tok.encode(" 5")]
    rows = model.add_rows(3)
    with pytest.raises(SpecdecError, match="3 rows"):
        model.add_rows(1)
    model.forward_rows(dict(zip(rows, prompts)))
    together = model.forward_rows(dict(zip(rows, steps)), {r: len(s) for r, s in zip(rows, steps)})
    assert [model.row_length(r) for r in rows] == [len(p) + len(s) for p, s in zip(prompts, steps)]
    model.rollback_rows({rows[1]: len(prompts[1])})
    assert model.row_length(rows[1]) == len(prompts[1]) and model.row_length(rows[0]) == len(prompts[0]) + len(steps[0])
    again = model.forward_rows({rows[1]: steps[1]}, {rows[1]: len(steps[1])})[rows[1]]
    np.testing.assert_array_equal(again.argmax(-1), together[rows[1]].argmax(-1))
    model.drop_rows(rows)
    for prompt, step, row_logits in zip(prompts, steps, (together[r] for r in rows)):
        [row] = model.add_rows(1)  # a reused sequence: nothing of the old row left
        model.forward_rows({row: prompt})
        alone = model.forward_rows({row: step}, {row: len(step)})[row]
        np.testing.assert_array_equal(alone.argmax(-1), row_logits.argmax(-1))
        assert np.abs(log_softmax(alone) - log_softmax(row_logits)).max() < BATCH_SHAPE_TOLERANCE
        model.drop_rows([row])
    model.close()


# the tokens whose log-probabilities a row in a batch must reproduce: on the 0.5B here, the other
# batch shapes' rounding moved the top 10 by at most 0.30 (120 checks of 40 operations; 0.45 for
# the top 50, 0.72 over the whole vocabulary, at log-probabilities near -20), one wrong token in
# the history by 0.97 to 14
TOP = 10


def _same_within_the_tie_rule(got: np.ndarray, fresh: np.ndarray, what: str) -> float:
    """The same next token (or a rounding tie for it), and the log-probabilities of the run alone's
    TOP tokens within the batch-shape tolerance (far in the tail, at log-probabilities near -20, the
    rounding of other batch shapes reaches 0.72 on the 0.5B; a cache that kept a rolled-back token
    moves the top of the distribution by far more). The largest difference there."""
    from specdec.compare import ROUNDING_GAP

    if got.argmax() != fresh.argmax():
        top2 = np.sort(fresh.astype(np.float64))[-2:]
        assert top2[1] - top2[0] < ROUNDING_GAP, f"{what}: argmax {got.argmax()} != {fresh.argmax()}, no tie"
    top = np.argsort(fresh)[-TOP:]
    diff = float(np.abs(log_softmax(got)[top] - log_softmax(fresh)[top]).max())
    assert diff < BATCH_SHAPE_TOLERANCE, (what, diff)
    return diff


def test_any_interleaving_of_forwards_and_rollbacks_leaves_every_row_right():
    """Three rows of one context through 24 seeded random operations: a forward of 1-6 tokens over
    some of the rows at once, a rollback of some rows (a rejected draft), a row dropped and a new
    one prefilled in its place. After each, every row scores one more token, all rows in ONE
    forward, and each row's logits equal a fresh single-row run of that row's tokens (the model's
    own sequence) under the tie rule; the probe is rolled back again."""
    from specdec import load_model

    model = load_model("qwen2.5-coder-0.5b", n_ctx=512, max_rows=3, progress=False)
    pool = model.tokenizer.encode(
        "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and "
        "j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
        "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n"
    )
    rng = np.random.default_rng(0)

    def piece(n):
        start = int(rng.integers(0, len(pool) - n))
        return pool[start : start + n]

    rows: dict[int, list[int]] = {}

    def prefill(new_rows):
        for row in new_rows:
            rows[row] = piece(int(rng.integers(3, 12)))
        model.forward_rows({row: rows[row] for row in new_rows})

    prefill(model.add_rows(3))
    ops = []
    try:
        for _ in range(24):
            op = rng.choice(["forward", "forward", "rollback", "replace"])
            ops.append(str(op))
            if op == "forward":
                chosen = [
                    int(r) for r in rng.choice(list(rows), size=int(rng.integers(1, len(rows) + 1)), replace=False)
                ]
                feed = {row: piece(int(rng.integers(1, 7))) for row in chosen}
                model.forward_rows(feed, {row: len(t) for row, t in feed.items()})
                for row, tokens in feed.items():
                    rows[row] += tokens
            elif op == "rollback":
                keep = {
                    row: int(rng.integers(1, len(t))) for row, t in rows.items() if len(t) > 1 and rng.random() < 0.7
                }
                model.rollback_rows(keep)
                for row, n in keep.items():
                    del rows[row][n:]
            else:
                gone = int(rng.choice(list(rows)))
                model.drop_rows([gone])
                del rows[gone]
                prefill(model.add_rows(1))
            assert {row: model.row_length(row) for row in rows} == {row: len(t) for row, t in rows.items()}
            probe = {row: piece(1) for row in rows}
            got = model.forward_rows(probe, {row: 1 for row in rows})
            model.rollback_rows({row: len(t) for row, t in rows.items()})
            for row, tokens in rows.items():
                model.reset()
                fresh = model.forward(tokens + probe[row], n_rows=1)[0]  # [vocab], alone
                _same_within_the_tie_rule(got[row][0], fresh, f"row {row} after {ops}")
        assert {"forward", "rollback", "replace"} <= set(ops)
        # power: one token of a row's history changed (what a cache that kept a rejected draft token
        # would hold) fails the same check
        row, tokens = next(iter(rows.items()))
        wrong = list(tokens)
        wrong[len(wrong) // 2] = next(t for t in pool if t != wrong[len(wrong) // 2])
        model.reset()
        with pytest.raises(AssertionError):
            _same_within_the_tie_rule(got[row][0], model.forward(wrong + probe[row], n_rows=1)[0], "power")
    finally:
        model.close()


# -- objects that point into llama.cpp, used after their model is gone (issue 93, finding 8) -----

AFTER_DROP = """
import gc, sys
from specdec import load_model
model = load_model("gemma-3-270m", n_ctx=256, progress=False)
tokenizer = model.tokenizer
saved_model_row = model.add_rows(1)[0]
model.forward_rows({saved_model_row: tokenizer.encode("hello")})
saved = model.save_row(saved_model_row)
del model
gc.collect()
ids = tokenizer.encode("hello world")
print(ids, repr(tokenizer.decode(ids)), tokenizer.token_text(ids[-1]), len(tokenizer.eog_ids) > 0,
      tokenizer.max_token_bytes() is not None, saved.length)
"""


def test_a_tokenizer_outlives_its_dropped_model():
    """`load_model(...).tokenizer` kept while the model is garbage-collected: encoding, decoding
    and the vocabulary's texts still work (the vocabulary lives as long as the tokenizer), where
    0af4022 killed the process (exit 139). In a process of its own, so that a crash fails this
    test instead of the run; a saved row (host memory) outlives the model too."""
    import subprocess
    import sys

    from ..conftest import _real_model

    _real_model("gemma-3-270m")  # assembled (or skipped where the models are not)
    run = subprocess.run([sys.executable, "-c", AFTER_DROP], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert "'hello world'" in run.stdout and run.stdout.strip().endswith("True True 2")


def test_every_object_refuses_use_after_close():
    """After model.close() (memory freed now), the model's context, cache, batch and vocabulary are
    gone: the model, its tokenizer and a saved row's way back in raise a SpecdecError naming the
    model, never read freed memory. Closing twice is harmless."""
    from specdec.errors import SpecdecError

    from ..conftest import _real_model

    model = _real_model("gemma-3-270m")
    tokenizer = model.tokenizer
    row = model.add_rows(1)[0]
    model.forward_rows({row: tokenizer.encode("hi there")})
    saved = model.save_row(row)
    model.close()
    model.close()
    for use in (
        lambda: tokenizer.encode("x"),
        lambda: tokenizer.token_text(1),
        lambda: tokenizer.apply_chat_template([{"role": "user", "content": "x"}]),
        lambda: model.forward_rows({row: [1]}),
        lambda: model.rollback_rows({row: 0}),
        lambda: model.save_row(row),
        lambda: model.load_row(row, saved),
    ):
        with pytest.raises(SpecdecError, match="was closed: load the model again"):
            use()


# raw text (no chat template: a short prompt, read anew by every batch) that prompt lookup copies
MIXED_PROMPT = (
    "def f(items):\n    x = 0\n    for i in items:\n        x += i\n    return x\n\n\ndef g(items):\n    x = 0\n"
)


BATCHES = 60


def test_greedy_and_sampled_rows_share_a_batch_losslessly(draft_model):
    """One batch of four rows on llama.cpp, two greedy and two sampled (temperature 1), prompt
    lookup drafting for all of them in the same steps: every greedy row is plain greedy decoding's
    output (or parts from it at a named rounding tie: tests/lossless.py), and the sampled rows'
    first two tokens follow the target's own probabilities (specdec.check's test against p at
    each prefix, at level 1e-3: with 120 samples it detects a shift of TV ~0.3 with probability
    0.8, a coarse check of the real backend's batching; the toy's exact test,
    tests/test_exact_engine.py, pins a greedy + sampled batch to 1e-9)."""
    from dataclasses import replace

    from scipy.stats import chi2

    from specdec import GenerationConfig, SpeculativeDecoder
    from specdec.check import detectable_tv, positions_test, target_probs

    from ..lossless import assert_greedy_lossless

    target = draft_model  # the 0.5B
    decoder = SpeculativeDecoder(target, "ngram", k=4, max_rows=4)
    greedy = GenerationConfig(max_new_tokens=3, chat=False)
    sampled = GenerationConfig(max_new_tokens=3, chat=False, temperature=1.0)
    tokens = decoder.prompt_tokens(MIXED_PROMPT, greedy)
    plain = SpeculativeDecoder(target, None).generate(tokens, greedy).tokens
    engine, outcomes, drafted = decoder.engine, [], 0
    for b in range(BATCHES):
        configs = [greedy, replace(sampled, seed=2 * b), greedy, replace(sampled, seed=2 * b + 1)]
        requests = [engine.add(list(tokens), c) for c in configs]
        engine.run(requests)
        for request, config in zip(requests, configs):
            result = request.result
            drafted += result.stats.drafted
            if config is greedy:
                assert_greedy_lossless(target, tokens, plain, result.tokens)
            else:
                outcomes.append(tuple(result.tokens) + ((-1,) if result.stats.finish_reason == "eog" else ()))
    assert drafted > 0  # the rows were speculated, side by side
    probs = target_probs(target, tokens, sampled.sampling)
    try:
        stat, df, tested, groups, impossible = positions_test(outcomes, probs, 2)
    finally:
        probs.close()
    assert impossible == 0 and df > 0
    assert chi2.sf(stat, df) > 1e-3, (stat, df)
    assert detectable_tv(df, 1e-3, len(outcomes)) < 0.3
