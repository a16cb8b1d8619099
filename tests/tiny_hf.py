"""Tiny transformers models with random weights, built in the tests (no hub, no files): a target
and a smaller draft that shares its vocabulary, for Llama, Qwen2 and GPT-2 architectures.

The draft is the target cut to its first layer (same embeddings, same first block, same head);
the target's second block writes to the residual stream with damped weights, so the draft agrees
with the target often enough for drafts to be accepted, rejected and fully accepted."""

from __future__ import annotations

import copy
import os

ARCHS = ("llama", "qwen2", "gpt2")
# where pair() puts the models: SPECDEC_TEST_DEVICE=cuda runs the torch backend's tests on a GPU
# (the caches' tests then also take static + CUDA graphs: LAYOUTS)
DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")
LAYOUTS = ("dynamic", "static", "static+graphs") if DEVICE.startswith("cuda") else ("dynamic", "static")
TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int\n    y: int\n"
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens, "
    "and the target keeps the ones it agrees with.\n"
) * 4


def tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (GPT-2 style) trained on a few lines, with an end token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def config(arch: str, vocab_size: int, layers: int = 2, positions: int = 512):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, initializer_range=0.3, bos_token_id=None, eos_token_id=0)
    if arch == "gpt2":
        return GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=positions, **common)
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    return cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        **common,
    )


def pair(arch: str, vocab_size: int, seed: int = 0, damp: float = 0.3):
    """(target, draft) transformers models: a 2-layer target and its first layer as the draft."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config(arch, vocab_size), attn_implementation="sdpa").eval()
    draft = AutoModelForCausalLM.from_config(config(arch, vocab_size, layers=1), attn_implementation="sdpa").eval()
    with torch.no_grad():  # damp what layer 1 adds, so that layer 0 alone is a decent draft
        for name, weight in target.named_parameters():
            if ".1." in name and name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                weight.mul_(damp)
    state = {k: v for k, v in copy.deepcopy(target.state_dict()).items() if not any(f".{i}." in k for i in range(1, 2))}
    draft.load_state_dict(state)
    return target.to(DEVICE), draft.to(DEVICE)


# (architecture, cache layout) for the torch backend's tests: every architecture dynamic, qwen2 in
# each other layout (static, and static + CUDA graphs on a GPU)
CASES = [(arch, "dynamic") for arch in ARCHS] + [("qwen2", layout) for layout in LAYOUTS[1:]]


def wrap(model, tokenizer, name: str, layout: str = "dynamic"):
    """A transformers model as our TransformersModel in one of LAYOUTS."""
    from specdec.models.transformers import TransformersModel

    return TransformersModel(model, tokenizer, name=name, cache=layout.split("+")[0], graphs="graphs" in layout)
