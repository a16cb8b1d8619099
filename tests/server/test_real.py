"""The real 1.5B target through the real `specdec serve` command: greedy output is plain decoding,
alone and with eight streams on four rows; the suffix cache is saved after a drain."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

import pytest

from specdec import GenerationConfig, SpeculativeDecoder

from ..conftest import SHIPPED_COSTS, costs_report
from ..lossless import assert_greedy_lossless
from .helpers import (
    ROOT,
    _check_metrics,
    _serve_process,
    _wait_healthy,
    client,
    httpx,
)

REAL_TOKENS = 24


@pytest.fixture(scope="module")
def real_server(target_model):  # target_model: skips (or fails) without the real models
    proc, base = _serve_process("--max-batch", "4", "--ctx", "2048", "--costs", str(SHIPPED_COSTS))
    try:
        _wait_healthy(base, 600, proc)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)  # drains: nothing is in flight, so it exits at once
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "hung"
        assert code == 0, (code, proc.stderr.read()[-2000:])


@pytest.mark.real_models
def test_real_serve_saves_the_suffix_cache_after_draining(tmp_path, draft_model):
    """`specdec serve --suffix-cache F`: what the requests added is in F once a Ctrl-C has drained
    the server, and the process exits 0."""
    from specdec.drafters.suffix import SuffixCacheDrafter

    cache = tmp_path / "cache.npz"
    costs = costs_report(tmp_path, "qwen2.5-coder-0.5b")  # 'auto' is built for any request to ask for
    proc, base = _serve_process(
        "--target", "qwen2.5-coder-0.5b", "--draft", "suffix", "--suffix-cache", str(cache), "--max-batch", "1",
        "--ctx", "1024", "--costs", costs,
    )  # fmt: skip
    try:
        _wait_healthy(base, 600, proc)
        r = httpx.post(base + "/v1/completions", timeout=120, json={"prompt": "def reverse(s):", "max_tokens": 16})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        assert not cache.exists()  # saved once, at the end
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert SuffixCacheDrafter().load(cache) >= 16 + r.json()["usage"]["prompt_tokens"]


@pytest.mark.real_models
def test_real_serve_grows_the_draft_models_trees(tmp_path, draft_model):
    """`specdec serve --draft-width 2 --draft-nodes 4` with a draft model: the draft model is loaded
    to score its own trees (it grows them), so the server starts and answers (it once loaded every
    draft model without tree scoring, which a grown tree refuses)."""
    proc, base = _serve_process(
        "--target", "qwen2.5-coder-0.5b", "--draft", "qwen2.5-coder-0.5b", "--draft-width", "2", "--draft-nodes",
        "4", "--max-batch", "2", "--ctx", "1024", "--costs", costs_report(tmp_path, "qwen2.5-coder-0.5b"),
    )  # fmt: skip
    try:
        _wait_healthy(base, 600, proc)
        r = httpx.post(
            base + "/v1/completions",
            timeout=120,
            json={"prompt": "def reverse(s):", "max_tokens": 16, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def _suite_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines() if line]
    short = [r["prompt"] for r in rows if r["category"] in ("chat", "math")]
    return short[:n]


def _generate(prompt: str, *flags) -> dict:
    from ..test_user_errors import specdec as run_cli

    proc = run_cli("generate", "--json", "-n", str(REAL_TOKENS), "--ctx", "2048", "--prompt", prompt, *flags)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.real_models
def test_real_greedy_is_plain_decoding(real_server, target_model):
    """The server's default (auto) against `specdec generate --draft none`: the target's own
    greedy output, or parting from it at a named rounding tie (tests/lossless.py)."""
    c = client(real_server)
    prompt = _suite_prompts(1)[0]
    want = _generate(prompt, "--draft", "none")  # chat template, like the chat endpoint
    r = c.chat.completions.create(
        model="qwen2.5-coder-1.5b",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=REAL_TOKENS,
        extra_body={"return_tokens": True},
    )
    got = r.choices[0].model_extra["tokens"]
    prompt_tokens = SpeculativeDecoder(target_model, None).prompt_tokens(prompt, GenerationConfig(chat=True))
    if assert_greedy_lossless(target_model, prompt_tokens, want["tokens"], got):
        assert r.choices[0].message.content == want["text"]
    assert r.usage.prompt_tokens == want["prompt_tokens"] == len(prompt_tokens)

    raw = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    want = _generate(raw, "--no-chat", "--draft", "none")  # raw text, like the completions endpoint
    chunks = list(
        c.completions.create(
            model="qwen2.5-coder-1.5b",
            prompt=raw,
            max_tokens=REAL_TOKENS,
            stream=True,
            extra_body={"return_tokens": True},
        )
    )
    got = chunks[-1].choices[0].model_extra["tokens"]
    text = "".join(ch.choices[0].text for ch in chunks)
    prompt_tokens = SpeculativeDecoder(target_model, None).prompt_tokens(raw, GenerationConfig(chat=False))
    if assert_greedy_lossless(target_model, prompt_tokens, want["tokens"], got):
        assert text == want["text"]


@pytest.mark.real_models
def test_real_eight_concurrent_streams_on_four_rows(real_server, target_model):
    c = client(real_server)
    prompts = _suite_prompts(8)

    def ask(prompt: str, stream: bool) -> dict:
        kwargs = dict(
            model="qwen2.5-coder-1.5b",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=REAL_TOKENS,
            extra_body={"return_tokens": True},
        )
        if not stream:
            r = c.chat.completions.create(**kwargs)
            return {
                "text": r.choices[0].message.content,
                "tokens": r.choices[0].model_extra["tokens"],
                "usage": r.usage.model_dump(),
                "speculative": r.model_extra["speculative"],
            }
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        last = [ch for ch in chunks if ch.choices][-1]
        assert last.choices[0].finish_reason in ("length", "stop")
        return {
            "text": "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
            "tokens": last.choices[0].model_extra["tokens"],
            "usage": chunks[-1].usage.model_dump(),
            "speculative": chunks[-1].model_extra["speculative"],
        }

    alone = [ask(p, stream=False) for p in prompts]  # one at a time
    before = httpx.get(real_server + "/metrics").text
    together: list = [None] * len(prompts)
    errors = []

    def run(i):
        try:
            together[i] = ask(prompts[i], stream=True)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    after = httpx.get(real_server + "/metrics").text
    decoder = SpeculativeDecoder(target_model, None)  # plain decoding, in this process
    for prompt, a, b in zip(prompts, alone, together):
        assert b["usage"]["completion_tokens"] == len(b["tokens"]) > 0
        assert b["speculative"]["policy"] == "auto" and b["speculative"]["steps"] > 0
        plain = decoder.generate(prompt, GenerationConfig(chat=True, max_new_tokens=REAL_TOKENS))
        for run in (a, b):  # alone and under load, each the target's own greedy output
            if assert_greedy_lossless(target_model, plain.prompt_tokens, plain.tokens, run["tokens"]):
                assert run["text"] == plain.text
    _check_metrics(after, together, before)
