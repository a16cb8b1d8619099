"""The HTTP API fuzzed from its fields (hypothesis): whatever a body holds, the answer is a 200 or
a 4xx with an OpenAI error body, never a 500, a hang or a dead server. The short form of the fault
suite; benchmarks/fault_soak.py is the long one (README, "Faults")."""

from __future__ import annotations

import json

from ..conftest import require_module
from .helpers import httpx, toy_server

hypothesis = require_module("hypothesis", "the test extra: pip install -e '.[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# strings that once gave 500s or that a tokenizer or a template may choke on
NASTY = st.sampled_from(["\ud800", "a\udfffb", "hi\x00 there", "<|im_end|>\n<|im_start|>system", "", " ", "é" * 9])
TEXT = NASTY | st.text(st.characters(exclude_categories=()), max_size=40)  # lone surrogates too

# any JSON value, including the awkward ones: huge and negative integers, floats at the edges,
# strings of any code point (lone surrogates too), deep-ish nesting
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "speculative",
    "return_tokens",
    "store",
    "metadata",
    "user",
    "tools",
    "response_format",
]
# values that are often valid, so that the fuzz gets past the first check and into the engine
LIKELY = {
    "prompt": TEXT | st.lists(st.integers(0, 40), min_size=1, max_size=8),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool"]),
                "content": st.text(st.characters(exclude_categories=()), max_size=30),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    "max_tokens": st.integers(-2, 300),
    "temperature": st.floats(-1, 3),
    "top_k": st.integers(-2, 50),
    "seed": st.integers(-1, 2**64),
    "stream": st.booleans(),
    "logprobs": st.booleans() | st.integers(-1, 25),
    "top_logprobs": st.integers(-1, 25),
    "speculative": st.fixed_dictionaries(
        {"draft": st.sampled_from(["auto", "ngram", "none", "suffix", "toy-draft", "bogus"]), "k": st.integers(-1, 40)}
    ),
}


def random_bodies():
    """Any of the fields, each holding likely values or any JSON value: mostly refused."""

    def field(name):
        return LIKELY[name] | VALUES if name in LIKELY else VALUES

    return st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: field(k) for k in keys})
    )


PLAIN = st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1, max_size=30) | NASTY


def valid_bodies(path: str):
    """Bodies that are mostly valid, so that the fuzz reaches the engine: a prompt or turns of any
    text, and valid values of the fields that steer it."""
    core = {"max_tokens": st.integers(1, 24)}
    if path == "/v1/completions":
        core["prompt"] = PLAIN | st.lists(st.integers(0, 40), min_size=1, max_size=8)
        core["logprobs"] = st.integers(0, 5)
    else:
        turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": PLAIN})
        core["messages"] = st.lists(turn, min_size=1, max_size=3)
        core["logprobs"] = st.booleans()
    optional = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(0, 40),
        "seed": st.integers(0, 2**64 - 1),
        "stream": st.booleans(),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
        "speculative": st.fixed_dictionaries(
            {"draft": st.sampled_from(["auto", "ngram", "none", "suffix", "toy-draft"])},
            optional={"k": st.integers(1, 8)},
        ).filter(lambda v: "k" not in v or v["draft"] not in ("auto", "none")),
    }
    return st.fixed_dictionaries(core, optional=optional)


def test_no_body_gets_a_500():
    with toy_server() as (base, service):
        statuses = []

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
        def ask(path, data):
            body = data.draw(valid_bodies(path) | random_bodies())
            content = json.dumps(body, ensure_ascii=True)
            r = httpx.post(base + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
            statuses.append(r.status_code)
            assert r.status_code in (200, 400, 404), (r.status_code, body, r.text[:300])
            if r.status_code != 200:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
            elif body.get("stream") is True:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
            else:
                assert r.json()["choices"], r.text

        ask()
        assert 200 in statuses and 400 in statuses  # it reached the engine and the checks both
        assert httpx.get(base + "/health").status_code == 200
        assert service.inflight == 0 and not service.worker.handles  # nothing left behind
