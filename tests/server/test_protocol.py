"""Request parsing (server/protocol.py): every malformed request is a 400 naming its field."""

from __future__ import annotations

import json

from .helpers import (
    httpx,
    toy_server,
)

BAD = [
    (b"{", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    # what once gave a 500 with a logged traceback (issue 28, item 5)
    (b"[" * 100_000, "nests too deeply"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "number out of range"),
    (b'{"prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "x", "\\ud800": 1}', "lone UTF-16 surrogate"),
    ({"prompt": "x", "n": 2}, "only n = 1"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "model": "gpt-4o"}, "model 'gpt-4o' is not served here"),
    ({"prompt": "x", "temperature": -1}, "'temperature' must be in [0, 2]"),
    ({"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
    ({"prompt": "x", "top_p": 0}, "'top_p' must be in (0, 1]"),
    ({"prompt": "x", "min_p": 1.5}, "'min_p'"),
    ({"prompt": "x", "top_k": 2.5}, "'top_k' must be an integer"),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be >= 1"),
    ({"prompt": "x", "max_tokens": True}, "'max_tokens' must be an integer"),
    ({"prompt": "x", "seed": -1}, "'seed'"),
    ({"prompt": "x", "stop": 5}, "'stop' must be a string or a list"),
    ({"prompt": "x", "stop": [""]}, "must not be empty"),
    ({"prompt": "x", "stream": "yes"}, "'stream' must be true or false"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 'only allowed with "stream": true'),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty is not supported"),
    ({"prompt": "x", "whatever": 1}, "unsupported field: whatever"),
    ({"prompt": "x", "speculative": {"draft": "ngram", "k": 0}}, "'speculative.k' must be in [1, 32]"),
    ({"prompt": "x", "seed": 2**64}, "'seed' must be in [0, 18446744073709551615]"),
    ({"prompt": "x", "store": "no"}, "'store' must be true or false"),
    ({"prompt": "x", "metadata": [1]}, "'metadata' must be an object"),
    ({"prompt": "x", "speculative": {"draft": "auto", "k": 4}}, "chooses k itself"),
    ({"prompt": "x", "speculative": {"model": "a.gguf"}}, "unknown field(s) model"),
    ({"prompt": "x", "speculative": {"draft": "suffix", "width": 0}}, "'speculative.width' must be in [1, 8]"),
    ({"prompt": "x", "speculative": {"draft": "ngram", "width": "2"}}, "'speculative.width' must be an integer"),
    ({"prompt": "x", "speculative": {"draft": "auto", "width": 2}}, "chooses its trees itself"),
    ({"prompt": "x", "speculative": {"draft": "toy-draft", "width": 2}}, "the shape the server loaded it with"),
    ({"prompt": ""}, "'prompt' is empty"),
    ({"prompt": ["a", "b"]}, "several prompts"),
    ({"prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ({"prompt": "x" * 300}, "the context holds 256"),
    ({"prompt": "x" * 200, "max_tokens": 100}, "at most 56 fit"),
    ({}, "'prompt' must be"),
]

BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "hi\u0000 write a poem about the sea"}]}, "NUL character"),
    (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "lone UTF-16 surrogate"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "a tool message (and only one) has a tool_call_id"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "only text parts",
    ),
    ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "unsupported field(s) audio"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format type must"),
    ({"messages": [{"role": "user", "content": "x"}], "json_schema": {"type": "objec"}}, "JSON schema is not valid"),
    ({"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= ("}, "not valid"),
    ({"messages": [{"role": "user", "content": "x"}], "grammar": 'root ::= "a"', "json_schema": {}}, "not both"),
    (
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 6},
        "not two different values",
    ),
]


def test_malformed_requests_are_400_with_a_clear_message():
    with toy_server() as (base, _):
        for path, cases in (("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)):
            for body, fragment in cases:
                r = httpx.post(base + path, content=body if isinstance(body, bytes) else json.dumps(body))
                assert r.status_code == 400, (body, r.status_code, r.text)
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert fragment in error["message"], (body, error)
        # no-op values of unsupported fields are fine
        r = httpx.post(
            base + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}], "name": "bob"}],
                "n": 1,
                "logprobs": False,
                "tools": [],
                "presence_penalty": 0,
                "max_completion_tokens": 3,
                "stop": "zzz",
                "top_k": -1,
                "store": False,
                "metadata": {"team": "search"},
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.get(base + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = httpx.get(base + "/v1/completions")
        assert r.status_code == 405 and "error" in r.json()


def test_an_error_names_the_field_at_fault():
    cases = [
        ("/v1/completions", {"prompt": "x", "speculative": {"draft": "ngram", "k": 99}}, "speculative.k"),
        ("/v1/completions", {"prompt": "x" * 300}, "prompt"),
        ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 100}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\u0000b"}]}, "messages"),
    ]
    with toy_server() as (base, _):
        for path, body, param in cases:
            r = httpx.post(base + path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_the_api_documents_the_bodies_it_reads():
    """/openapi.json describes the request bodies the completion routes check (server/schema.py),
    with their bounds, and /docs serves its page; both open, as /health is."""
    with toy_server(api_key="k") as (base, _):
        doc = httpx.get(base + "/openapi.json").json()
        schemas = doc["components"]["schemas"]
        for path, name in (("/v1/chat/completions", "ChatRequest"), ("/v1/completions", "CompletionRequest")):
            body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": f"#/components/schemas/{name}"}
        chat, completion = schemas["ChatRequest"], schemas["CompletionRequest"]
        assert {"messages", "temperature", "speculative", "stream_options"} <= set(chat["properties"])
        assert "messages" in chat["required"] and "prompt" in completion["required"]
        assert "messages" not in completion["properties"] and "echo" not in chat["properties"]
        temperature = next(t for t in chat["properties"]["temperature"]["anyOf"] if t["type"] == "number")
        assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
        assert {"draft", "k", "width"} <= set(schemas["Speculative"]["properties"])
        assert httpx.get(base + "/docs").status_code == 200
