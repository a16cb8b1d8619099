"""Structured outputs on the real 1.5B target (issue 96): greedy speculation under a schema is plain
decoding under it, and the openai SDK's structured-output calls work against the real server,
every output validated against its schema (jsonschema), streamed and not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.compare import ROUNDING_GAP
from specdec.costs import cost_table
from specdec.grammar import Grammars
from specdec.server.app import build_service

from ..conftest import SHIPPED_COSTS
from .helpers import client, serving

jsonschema = pytest.importorskip("jsonschema")
SUITE = [json.loads(line) for line in (Path(__file__).resolve().parents[2] / "benchmarks" / "structured.jsonl").open()]
PICKED = ["extract-person-01", "record-config-01", "call-book_table", "review-03"]
ITEMS = [i for i in SUITE if i["id"] in PICKED]
TOKENS = 120


def _schema(item) -> dict:
    return item["response_format"]["json_schema"]["schema"]


def _parted_at_a_tie(target, prompt_tokens, plain, spec, constraint_spec) -> str | None:
    """Where greedy outputs part: None if the target's masked top two there are within rounding
    (llama.cpp's batched and single-token kernels round differently), else why not."""
    i = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
    c = Grammars(target).constraint(constraint_spec)
    c.consume(plain[:i])
    row = target.add_rows(1)[0]
    try:
        logits = target.forward_rows({row: [*prompt_tokens, *plain[:i]]}, {row: 1})[row][0]
    finally:
        target.drop_rows([row])
    allowed = c.allowed()
    gap = abs(float(logits[plain[i]]) - float(logits[spec[i]]))
    if allowed[plain[i]] and allowed[spec[i]] and gap < ROUNDING_GAP:
        return None
    return f"parted at token {i}: {plain[i]} vs {spec[i]}, logit gap {gap:.3f} (not a tie)"


@pytest.mark.real_models
@pytest.mark.parametrize("method", ["ngram", "draft", "auto"])
def test_real_greedy_under_a_schema_is_plain_decoding_under_it(target_model, draft_model, method):
    plain = SpeculativeDecoder(target_model, None)
    spec = {
        "ngram": lambda: SpeculativeDecoder(target_model, "ngram", k=8),
        "draft": lambda: SpeculativeDecoder(target_model, draft_model, k=4),
        "auto": lambda: SpeculativeDecoder(
            target_model,
            "auto",
            draft_model=draft_model,
            costs=tuple(cost_table(json.loads(SHIPPED_COSTS.read_text()), r) for r in ("target", "draft")),
        ),
    }[method]()
    forced = 0
    for item in ITEMS:
        cfg = GenerationConfig(max_new_tokens=TOKENS, response_format=item["response_format"])
        a, b = plain.generate(item["prompt"], cfg), spec.generate(item["prompt"], cfg)
        if a.tokens != b.tokens:
            problem = _parted_at_a_tie(target_model, a.prompt_tokens, a.tokens, b.tokens, cfg.constraint)
            assert problem is None, (item["id"], problem)
            continue
        if a.stats.finish_reason == "eog":
            jsonschema.validate(json.loads(a.text), _schema(item))
        forced += b.stats.forced_kept
    assert forced > 0  # the schema's forced tokens were drafted and kept


@pytest.fixture(scope="module")
def real_service_base(target_model, draft_model):
    report = json.loads(SHIPPED_COSTS.read_text())
    service = build_service(
        target_model,
        draft_model,
        max_batch=2,
        model_names=("qwen2.5-coder-1.5b",),
        draft_name="qwen2.5-coder-0.5b",
        costs=(cost_table(report, "target"), cost_table(report, "draft")),
    )
    try:
        with serving(service) as base:
            yield base
    finally:
        service.close()


@pytest.mark.real_models
@pytest.mark.parametrize("stream", [False, True])
def test_real_schema_outputs_validate_through_the_openai_client(real_service_base, stream):
    c = client(real_service_base)
    for item in ITEMS:
        kwargs = dict(
            model="qwen2.5-coder-1.5b",
            messages=[{"role": "user", "content": item["prompt"]}],
            response_format=item["response_format"],
            max_tokens=TOKENS,
        )
        if stream:
            pieces, finish = [], None
            for chunk in c.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            text = "".join(pieces)
        else:
            r = c.chat.completions.create(**kwargs)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish in ("stop", "length"), finish
        if finish == "stop":
            jsonschema.validate(json.loads(text), _schema(item))


@pytest.mark.real_models
def test_real_openai_parse_with_a_pydantic_model(real_service_base):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int
        city: str

    c = client(real_service_base)
    r = c.beta.chat.completions.parse(
        model="qwen2.5-coder-1.5b",
        messages=[{"role": "user", "content": "Extract: Ines Moreau, 31, lives in Lille."}],
        response_format=Person,
        max_tokens=60,
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.age == 31 and "Ines" in person.name


@pytest.mark.real_models
def test_real_json_mode_and_llama_server_fields(real_service_base):
    import httpx

    c = client(real_service_base)
    r = c.chat.completions.create(
        model="qwen2.5-coder-1.5b",
        messages=[{"role": "user", "content": "Give the capital of France as a JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=40,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # llama-server's own fields, as its clients send them
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    body = {"prompt": "2 + 3 = ", "json_schema": schema, "max_tokens": 20}
    out = httpx.post(real_service_base + "/v1/completions", json=body, timeout=120).json()
    assert json.loads(out["choices"][0]["text"])["answer"] == 5
    body = {"prompt": "Is water wet? Answer: ", "grammar": 'root ::= "yes" | "no"', "max_tokens": 5}
    out = httpx.post(real_service_base + "/v1/completions", json=body, timeout=120).json()
    assert out["choices"][0]["text"] in ("yes", "no")
    bad = httpx.post(
        real_service_base + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}},
        },
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    assert "JSON schema is not valid" in bad.json()["error"]["message"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
CHOICES = {
    "none": "none",
    "auto": "auto",
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}


def _ask(c, messages, choice, stream: bool):
    """(content, tool_calls as dicts, finish_reason) of one chat call, streamed or not."""
    kwargs = dict(
        model="qwen2.5-coder-1.5b",
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        parallel_tool_calls=False,  # one call, then the end (this model would call again and again)
        max_tokens=80,
    )
    if not stream:
        r = c.chat.completions.create(**kwargs)
        m = r.choices[0].message
        calls = [
            {"id": t.id, "type": t.type, "function": {"name": t.function.name, "arguments": t.function.arguments}}
            for t in m.tool_calls or []
        ]
        return m.content, calls, r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for t in delta.tool_calls or []:
            call = calls.setdefault(
                t.index, {"id": t.id, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["function"]["name"] += t.function.name or ""
            call["function"]["arguments"] += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


@pytest.mark.real_models
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_real_tool_calls_round_trip_through_the_openai_client(real_service_base, choice, stream):
    """A two-turn conversation: the model calls get_weather (required and a named function force
    a call; none answers in text; auto lets the model choose, and a call it makes is held to the
    schema from its opening), the call's arguments follow the tool's schema, and the tool's
    result goes back for the answer."""
    c = client(real_service_base)
    messages = [{"role": "user", "content": "What is the weather in Oslo right now, in celsius?"}]
    content, calls, finish = _ask(c, messages, CHOICES[choice], stream)
    if choice == "none":
        assert not calls and content and finish in ("stop", "length")
        return
    if choice == "auto" and not calls:  # auto may answer in text (this 1.5B coder writes a JSON block)
        assert content and "<tool_call>" not in content and finish in ("stop", "length"), (content, finish)
        return
    assert finish == "tool_calls" and calls, (content, calls, finish)
    for call in calls:
        assert call["function"]["name"] == "get_weather" and call["id"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": calls},
        *(
            {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 4, "sky": "light rain"}'}
            for call in calls
        ),
    ]
    answer, more, finish = _ask(c, messages, "none", stream)
    assert not more and finish in ("stop", "length") and answer


@pytest.mark.real_models
def test_real_the_readmes_tool_call_example_runs(real_service_base):
    """The README's example as it stands: the SDK's own message object goes back in the history."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = re.search(r"## Structured outputs and tool calls.*?```python\n(.*?)```", readme, re.S).group(1)
    example = example.replace("http://localhost:8000", real_service_base)
    printed = []
    exec(compile(example, "README.md", "exec"), {"print": printed.append})
    assert printed and isinstance(printed[0], str) and printed[0]
