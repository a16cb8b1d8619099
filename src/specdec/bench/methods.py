"""The methods `specdec bench` compares: ours (spec.METHODS, run by our engine) and the peers'
(llama.cpp's binaries, transformers), by name, and the default lists of them. Parsing a name loads
nothing, so a typo fails before any model is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SpecdecError

if TYPE_CHECKING:
    from ..spec import DraftSpec

DEFAULT_METHODS = ("plain", "auto", "draft:2", "draft:4", "ngram:8", "ngram:16")
# A second plain run of every prompt, interleaved with the methods like any other (run_bench's
# `noise`): its speedup over plain is the bench's own noise
NOISE_METHOD = "plain#2"
LLAMA_CPP_METHODS = ("llama.cpp:plain", "llama.cpp:draft:4", "llama.cpp:ngram-simple:8", "llama.cpp:ngram-mod:8")
FULL_METHODS = ("plain", "auto", *(f"draft:{k}" for k in range(1, 9)), "ngram:2", "ngram:4", "ngram:8", "ngram:16")
HF_METHODS = ("hf:plain", "hf:assisted:4", "hf:prompt-lookup:8")
# vLLM (`make vllm-peer`): its own methods, and our drafters inside it (specdec.vllm)
VLLM_METHODS = ("vllm:plain", "vllm:ngram:8", "vllm:draft:4", "vllm:specdec:auto:16", "vllm:specdec:ngram:8")


def vllm_engines(methods: list[str], repeats: int) -> int:
    """The vLLM engines a bench of these methods keeps open at once (Bench._vllm_peer)."""
    from ..vllm_peer import VLLM_LEARNING_KINDS

    kinds = [parse_method(m)[1] for m in methods if m.startswith("vllm:")]
    return sum(repeats if kind in VLLM_LEARNING_KINDS else 1 for kind in kinds)


def _count(text: str) -> int:
    """A peer method's K as our methods read theirs (spec.count), 0 where it is not one."""
    from ..spec import count

    try:
        return count(text)
    except ValueError:
        return 0


def parse_method(method: str) -> tuple[str, DraftSpec | str, int]:
    """One of our methods (spec.METHODS) -> ('specdec', its DraftSpec, k); a peer's,
    'llama.cpp:plain' | 'llama.cpp:draft:K' | 'llama.cpp:<ngram type>:K' | 'hf:plain' |
    'hf:assisted:K' | 'hf:prompt-lookup:K' | 'vllm:plain' | 'vllm:<VLLM_KINDS>:K' -> (runner, the
    peer's drafter, k)."""
    from ..spec import METHODS
    from ..spec import parse_method as parse_ours
    from ..vllm_peer import METHODS as VLLM
    from ..vllm_peer import parse_method as parse_vllm

    runner, _, rest = method.partition(":")
    if method == NOISE_METHOD:
        return "specdec", parse_ours("plain"), 0
    if runner == "vllm":
        found = parse_vllm(rest)
        if found is not None:
            return runner, *found
    elif runner not in ("llama.cpp", "hf"):
        spec = parse_ours(method)
        if spec is not None:
            return "specdec", spec, spec.k
    else:
        drafter, _, k = rest.rpartition(":")
        if rest == "plain":
            return runner, "plain", 0
        if _count(k) >= 1 and (
            (runner == "llama.cpp" and (drafter == "draft" or drafter.startswith("ngram")))
            or (runner == "hf" and drafter in ("assisted", "prompt-lookup"))
        ):
            return runner, drafter, int(k)
    raise SpecdecError(
        f"unknown method {method!r}: use {METHODS}, llama.cpp:plain, "
        f"llama.cpp:draft:K, llama.cpp:ngram-simple:K (or another llama.cpp n-gram type), hf:plain, hf:assisted:K, "
        f"hf:prompt-lookup:K, {VLLM}"
    )
