"""The torch backend on a built-in GGUF (dequantised by transformers), paired with a llama.cpp
draft of the same vocabulary: the engine does not care which backend each side uses."""

from __future__ import annotations

import pytest

from .conftest import needs_torch

needs_torch()

from specdec import SpeculativeDecoder, load_model  # noqa: E402

pytestmark = pytest.mark.real_models


@pytest.fixture(scope="module")
def torch_target(draft_model):  # draft_model: the llama.cpp 0.5B, which also checks the files are there
    return load_model("qwen2.5-coder-0.5b", backend="torch", device="cpu", dtype="float32", n_ctx=1024, progress=False)


def test_the_gguf_loads_with_its_vocabulary_and_template(torch_target, draft_model):
    tok, ref = torch_target.tokenizer, draft_model.tokenizer
    assert torch_target.vocab_size == draft_model.vocab_size and torch_target.is_instruct
    text = "def café(x):\n    return x ** 2  # → 🙂"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert ref.eog_ids & tok.eog_ids and tok.eog_ids <= ref.eog_ids
    # both render the GGUF's Jinja template (with Qwen's default system message): one prompt
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages)


def test_a_llama_cpp_draft_for_a_torch_target(torch_target, draft_model):
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    plain = SpeculativeDecoder(torch_target).generate(prompt, max_new_tokens=32)
    spec = SpeculativeDecoder(torch_target, draft_model, k=4).generate(prompt, max_new_tokens=32)
    assert spec.tokens == plain.tokens
    # the same weights, quantised on one side: the draft is right most of the time
    assert spec.stats.acceptance_rate > 0.6, spec.stats.acceptance_rate
