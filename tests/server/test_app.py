"""The HTTP API (server/app.py) with the real OpenAI client: chat and completions, streamed and not;
a request choosing its speculation; one suffix cache for every request; the API key."""

from __future__ import annotations

import json
import os

import pytest

from .helpers import (
    AUTO,
    GenerationConfig,
    SpeculativeDecoder,
    _toy_models,
    build_service,
    client,
    httpx,
    openai,
    reference,
    serving,
    toy_server,
)


def test_openai_client_chat_and_completions_stream_and_not():
    with toy_server() as (base, service):
        c = client(base)
        assert [m.id for m in c.models.list().data] == ["toy"]
        plain_target, _ = _toy_models()
        want_chat = reference(plain_target, "abc abc abc", True, 24)
        want_text = reference(plain_target, "hello world hello", False, 24)

        r = c.chat.completions.create(model="toy", messages=[{"role": "user", "content": "abc abc abc"}], max_tokens=24)
        assert r.choices[0].message.content == want_chat and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
        spec = r.model_extra["speculative"]
        assert spec["policy"] == "auto" and spec["steps"] > 0
        assert set(spec) >= {
            "drafted",
            "accepted",
            "acceptance_rate",
            "acceptance_by_position",
            "mean_accepted_length",
            "decisions",
        }

        chunks = list(
            c.chat.completions.create(
                model="toy",
                messages=[{"role": "user", "content": "abc abc abc"}],
                max_tokens=24,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want_chat
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].model_extra["speculative"]["steps"] > 0

        r = c.completions.create(model="toy", prompt="hello world hello", max_tokens=24)
        assert r.choices[0].text == want_text and r.usage.completion_tokens == 24
        assert r.model_extra["speculative"]["policy"] == "auto"
        chunks = list(c.completions.create(model="toy", prompt="hello world hello", max_tokens=24, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == want_text
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 24

        # the raw stream ends with [DONE]; without include_usage no choice-less chunk is sent
        with httpx.stream(
            "POST", base + "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "stream": True}
        ) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and all(json.loads(x[6:])["choices"] for x in lines[:-1])


def test_each_request_may_choose_its_speculation():
    with toy_server() as (base, _):
        c = client(base)
        want = reference(_toy_models()[0], "abcabcabc abcabc", False, 32)
        seen = {}
        for spec in ({"draft": "none"}, {"draft": "ngram", "k": 3}, {"draft": "toy-draft", "k": 2}, {"draft": "auto"}):
            r = c.completions.create(
                model="toy", prompt="abcabcabc abcabc", max_tokens=32, extra_body={"speculative": spec}
            )
            assert r.choices[0].text == want, spec  # greedy: whatever drafts, the target's own text
            seen[spec["draft"]] = r.model_extra["speculative"]
        assert seen["none"]["drafted"] == 0 and set(seen["none"]["decisions"]) == {"plain"}
        assert seen["ngram"]["policy"] == "ngram:3" and set(seen["ngram"]["decisions"]) <= {
            "plain",
            "ngram:1",
            "ngram:2",
            "ngram:3",
        }
        assert seen["toy-draft"]["policy"] == "model:2" and seen["toy-draft"]["drafted"] > 0
        assert all(k.startswith("draft:") for k in seen["toy-draft"]["decisions"])
        # a request names what the server loaded, never a file
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "speculative": {"draft": "/etc/passwd"}})
        assert r.status_code == 400 and "auto, ngram, none, suffix, toy-draft" in r.json()["error"]["message"]


def test_one_suffix_cache_serves_every_request():
    """The server's suffix cache hears every finished request: the same request again is drafted
    from the first one's answer, whichever policy the first one used."""
    with toy_server() as (base, service):
        c = client(base)
        prompt = "the quick brown fox"
        want = reference(_toy_models()[0], prompt, False, 32)
        runs = [
            c.completions.create(model="toy", prompt=prompt, max_tokens=32, extra_body={"speculative": spec})
            for spec in ({"draft": "none"}, {"draft": "suffix", "k": 4})
        ]
        assert [r.choices[0].text for r in runs] == [want, want]
        spec = runs[1].model_extra["speculative"]
        assert spec["policy"] == "suffix:4" and spec["drafted"] > 0 and spec["accepted"] == spec["drafted"]


def test_a_request_may_draft_prompt_lookups_and_the_suffix_caches_trees():
    """Trees of prompt lookup and the suffix cache, the server's default or a request's own width,
    where the target scores trees: the target's own greedy text. Where it scores chains only, a
    request's tree is a 400 naming the field."""
    from specdec.spec import DraftSpec

    with toy_server(policy=DraftSpec("suffix", k=4, width=2)) as (base, service):
        suffix = service.worker.router.drafters["suffix"]
        widths = []
        propose = suffix.propose
        suffix.propose = lambda contexts, ks, w=None: widths.append(dict(w or {})) or propose(contexts, ks, w)
        c = client(base)
        prompt = "abcabcabc abcabc"
        want = reference(_toy_models()[0], prompt, False, 32)
        runs = {
            label: c.completions.create(model="toy", prompt=prompt, max_tokens=32, extra_body=extra)
            for label, extra in (
                ("default", {}),
                ("ngram:4x3", {"speculative": {"draft": "ngram", "k": 4, "width": 3}}),
                ("suffix:6x3", {"speculative": {"draft": "suffix", "k": 6, "width": 3}}),
                ("suffix:6", {"speculative": {"draft": "suffix", "k": 6}}),
            )
        }
        for label, r in runs.items():
            assert r.choices[0].text == want, label  # greedy: the target's own text, tree or chain
        assert runs["default"].model_extra["speculative"]["policy"] == "suffix:4x2"
        assert runs["ngram:4x3"].model_extra["speculative"]["policy"] == "ngram:4x3"
        assert runs["suffix:6x3"].model_extra["speculative"]["drafted"] > 0
        asked = {w for call in widths for w in call.values() if w}
        assert {1, 2, 3} <= asked  # each request's own width reached the cache (a chain: 1)

    class ChainsOnly(type(_toy_models()[0])):
        scores_trees = False

    target, draft = ChainsOnly(seed=1, n_ctx=256), _toy_models()[1]
    with serving(build_service(target, draft, DraftSpec("auto", k=0), 2, ("toy",), "toy-draft")) as base:
        r = httpx.post(
            base + "/v1/completions", json={"prompt": "x", "speculative": {"draft": "suffix", "k": 4, "width": 2}}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative.width"
        assert "scores chains only" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="scores them"):
        build_service(target, draft, DraftSpec("suffix", k=4, width=2), 2, ("toy",), "toy-draft")


def test_api_key():
    with toy_server(api_key="s3cret") as (base, _):
        body = {"prompt": "ab", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(base + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + "/v1/models").status_code == 401
        assert client(base, "s3cret").completions.create(model="toy", prompt="ab", max_tokens=2).usage
        assert httpx.get(base + "/health").status_code == 200  # probes need no key


def test_what_sdks_and_probes_call():
    """models.retrieve() (GET /v1/models/{id}), HEAD /health, and a completion near the end of the
    context without max_tokens: it gets what fits of the default 16, not an error."""
    with toy_server() as (base, _):
        c = client(base)
        assert c.models.retrieve("toy").id == "toy"
        r = httpx.get(base + "/v1/models/gpt-4o")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert httpx.head(base + "/health").status_code == 200
        r = httpx.post(base + "/v1/completions", json={"prompt": "x" * 250})  # toy context: 256
        assert r.status_code == 200, r.text
        body = r.json()
        assert 0 < body["usage"]["completion_tokens"] < 16 and body["choices"][0]["finish_reason"] == "length"


def test_logprobs_are_the_targets_as_openai_shows_them():
    """chat's logprobs + top_logprobs and completions' logprobs: N, whole and streamed, equal the
    target's own log-probabilities (plain decoding's, computed one token at a time)."""
    from specdec import GenerationConfig, SpeculativeDecoder

    with toy_server() as (base, _):
        c = client(base)
        plain_target, _ = _toy_models()
        plain = SpeculativeDecoder(plain_target, None)
        want_chat = plain.generate("abc abc abc", GenerationConfig(max_new_tokens=12, chat=True, logprobs=2))
        want_text = plain.generate("hello world hello", GenerationConfig(max_new_tokens=12, chat=False, logprobs=2))

        r = c.chat.completions.create(
            model="toy",
            messages=[{"role": "user", "content": "abc abc abc"}],
            max_tokens=12,
            logprobs=True,
            top_logprobs=2,
            # a fixed drafter: auto may step aside on its live timing, and this test needs drafts kept
            extra_body={"speculative": {"draft": "toy-draft", "k": 4}},
        )
        content = r.choices[0].logprobs.content
        assert len(content) == 12 and r.model_extra["speculative"]["accepted"] > 0
        for got, want in zip(content, want_chat.logprobs):
            assert bytes(got.bytes) == plain_target.tokenizer.token_bytes(want.token)
            assert got.logprob == pytest.approx(want.logprob, abs=1e-6)
            assert [t.logprob for t in got.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-6)
        streamed = [
            item
            for chunk in c.chat.completions.create(
                model="toy",
                messages=[{"role": "user", "content": "abc abc abc"}],
                max_tokens=12,
                logprobs=True,
                top_logprobs=2,
                stream=True,
            )
            if chunk.choices and chunk.choices[0].logprobs
            for item in chunk.choices[0].logprobs.content
        ]
        assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]

        r = c.completions.create(model="toy", prompt="hello world hello", max_tokens=12, logprobs=2)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs == pytest.approx([e.logprob for e in want_text.logprobs], abs=1e-6)
        # keyed by text, as OpenAI's: two tokens of one text (parts of a character) share a key
        for top, want in zip(lp.top_logprobs, want_text.logprobs):
            assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(want.top[0][1], abs=1e-6)
        assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0

        r = httpx.post(
            base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = httpx.post(base + "/v1/completions", json={"prompt": "a", "logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_what_a_seed_promises():
    """README, "seed": the same seeded sampled request, alone, gives the same text again under a
    drafter whose drafts depend on the request alone (none, ngram, the draft model); it is the
    target's distribution either way, but auto and the suffix cache draft from what earlier
    requests left, so their repeats may differ."""
    with toy_server() as (base, _):
        for draft in ("none", "ngram", "toy-draft"):
            body = {"prompt": "abc abd abc", "max_tokens": 24, "temperature": 0.9, "seed": 11}
            body["speculative"] = {"draft": draft}
            texts = {httpx.post(base + "/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)}
            assert len(texts) == 1, (draft, texts)


def test_a_reproducible_server_repeats_a_seed_under_every_policy():
    """serve --reproducible: sampling by position, so the same seeded request gives one text under
    every policy, auto and the suffix cache (which draft from earlier requests) included, and
    beside other requests."""
    import concurrent.futures

    with toy_server(reproducible=True) as (base, _):

        def ask(draft: str, seed: int = 11) -> str:
            body = {"prompt": "abc abd abc", "max_tokens": 24, "temperature": 0.9, "seed": seed}
            body["speculative"] = {"draft": draft}
            return httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        drafts = ("none", "ngram", "toy-draft", "suffix", "auto") * 2
        texts = {ask(draft) for draft in drafts}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # and beside other seeded requests
            texts |= set(pool.map(ask, drafts, [11] * len(drafts)))
            others = set(pool.map(ask, ["none"] * 4, [12, 13, 14, 15]))
        assert len(texts) == 1, texts
        assert len(others | texts) > 1  # other seeds, other texts: the seed is what decides


def test_a_body_that_trickles_in_is_timed_out():
    """A client sending its body a byte at a time holds a socket, not the server: past the body
    timeout it gets a 408 and the connection is closed."""
    import socket
    import time

    with toy_server() as (base, service):
        service.body_timeout = 0.5
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            started = time.monotonic()
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert time.monotonic() - started < 5
        assert httpx.get(base + "/health").status_code == 200


def test_headers_that_trickle_in_are_timed_out():
    """A client that never finishes its request headers (a byte at a time, or nothing at all) holds
    a socket only until the header timeout: a partial request gets a 408 and the connection is
    closed; a connection that sent nothing is closed; so is one that, after a response, starts the
    next request and never finishes its headers. The recv timeout (10 s) is the bound: past the
    header timeout (0.5 s) the server must have acted. The clock stops once the headers are in: a
    request that runs for longer is answered whole."""
    import socket

    from .helpers import metric

    with toy_server(delay=0.02) as (base, service):
        service.header_timeout = 0.5
        host, port = base.removeprefix("http://").split(":")
        address = (host, int(port))

        def read_all(sock) -> bytes:
            data = b""
            while chunk := sock.recv(4096):  # until the server closes the connection
                data += chunk
            return data

        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"

        with socket.create_connection(address, timeout=10) as sock:
            assert read_all(sock) == b""  # nothing asked, nothing answered: closed

        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = b""
            while not first.endswith(b'{"status":"ok"}'):  # the whole response, body included
                first += sock.recv(4096)
            assert first.startswith(b"HTTP/1.1 200"), first[:200]
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request on the same connection
            reply = read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]

        assert metric(httpx.get(base + "/metrics").text, "specdec:request_rejected_total", status="408") == 2
        body = {"prompt": "abc", "max_tokens": 40, "speculative": {"draft": "none"}}  # 40 forwards of 20 ms
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
        assert httpx.get(base + "/health").status_code == 200  # and the server goes on


@pytest.mark.parametrize("kind", ["medusa", "early-exit", "early-exit on torch"])
def test_a_trained_head_per_request(tmp_path, monkeypatch, kind):
    """`specdec serve --draft head:FILE`: requests ask for the head by name ('head') with their own
    k, beside plain rows in the same steps, and get the target's own greedy text (an early exit:
    its draft model, on the target's backend with room for the server's rows; on torch, its blocks
    through the target's own cache)."""
    from specdec.build import make_drafter
    from specdec.models.numpy_ref import load_numpy_model
    from specdec.spec import DraftSpec

    from ..drafters.heads import random_head
    from ..models.test_numpy_ref import write_tiny_gguf

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))  # auto's cost curve is timed and cached there
    path = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=3, n_ctx=2048)
    target = load_numpy_model(path, n_ctx=2048)
    reference = load_numpy_model(path)
    if kind == "early-exit on torch":
        pytest.importorskip("torch")
        from specdec.drafters.early_exit import EarlyExitDrafter
        from specdec.models.transformers import load_transformers_model

        kind, head_path = "early-exit", random_head(target, "early-exit", tmp_path / "m.head")
        target = reference = load_transformers_model(path, device="cpu", dtype="float32", n_ctx=2048)
        head = make_drafter(DraftSpec("head", head=str(head_path)), target)
        assert isinstance(head, EarlyExitDrafter) and head.blocks
    else:
        head = make_drafter(DraftSpec("head", head=str(random_head(target, kind, tmp_path / "m.head"))), target)
    want = SpeculativeDecoder(reference).generate("the cat", GenerationConfig(max_new_tokens=20, chat=False))
    service = build_service(target, None, DraftSpec("head", k=3), 4, ("tiny",), head=head)
    with serving(service) as base:
        c = client(base)
        for extra in ({}, {"speculative": {"draft": "head", "k": 2}}, {"speculative": {"draft": "none"}}):
            r = c.completions.create(model="tiny", prompt="the cat", max_tokens=20, extra_body=extra)
            assert r.choices[0].text == want.text
            spec = r.model_extra["speculative"]
            assert (spec["drafted"] > 0) == (extra.get("speculative", {}).get("draft") != "none"), spec


def test_special_tokens_in_messages_only_when_the_server_says_so(monkeypatch, tmp_path):
    """`specdec serve --special-in-turns` (the CLI, its flag, the service it builds): a chat
    message that spells <|im_end|> and <|im_start|> is tokenized with those control tokens only on
    the server started with the flag; without it they stay text. A request cannot ask for it."""
    import specdec.cli.serve as cli_serve
    import specdec.server.app as server_app
    from specdec import request
    from specdec.cli import main

    from ..test_request import INJECTION, chatml_model

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))  # auto's cost curve is timed and cached there
    monkeypatch.setattr(
        cli_serve, "_model_loader", lambda args, rows: lambda name, backend=None, trees=True: chatml_model()
    )
    services = []
    monkeypatch.setattr(server_app, "serve", lambda service, *args, **kwargs: services.append(service) or 0)
    for flags in ([], ["--special-in-turns"]):
        assert main(["serve", "--draft", "none", "--draft-model", "none", "--served-model-name", "m", *flags]) == 0
    messages = [{"role": "user", "content": INJECTION}]
    model = chatml_model()
    as_text = request.tokens(model, None, messages=messages)
    as_tokens = request.tokens(model, None, messages=messages, special_in_turns=True)
    assert len(as_tokens) < len(as_text)
    for service, want in zip(services, (as_text, as_tokens)):
        assert service.special_in_turns is (want is as_tokens)
        with serving(service) as base:
            body = {"model": "m", "messages": messages, "max_tokens": 1}
            r = httpx.post(base + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(want)
            r = httpx.post(base + "/v1/chat/completions", json={**body, "special_in_turns": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "special_in_turns", r.text


def test_a_repeated_prompt_is_read_from_the_kept_cache_and_says_so():
    """The prefix cache (on by default): the same prompt again is answered from the row the first
    one left (all but its last token cached, as usage.prompt_tokens_details.cached_tokens says,
    with the OpenAI client reading it), with the same text; --no-prefix-cache reads it again."""
    body = dict(model="toy", prompt="hello world hello world hello", max_tokens=12, temperature=0)
    for cache in (True, False):
        with toy_server(max_batch=1, prefix_cache=cache) as (base, _):
            c = client(base)
            first, again = (c.completions.create(**body) for _ in range(2))
            assert first.choices[0].text == again.choices[0].text
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            want = first.usage.prompt_tokens - 1 if cache else 0
            assert again.usage.prompt_tokens_details.cached_tokens == want


def test_recorded_requests_are_what_specdec_train_reads(tmp_path):
    """`--record-requests FILE`: each accepted request's prompt appended as a JSON line in the form
    `specdec train --requests` reads (a chat's messages as the server read them, a text completion's
    prompt, streamed or not) once the engine admits it; a prompt of token ids and a refused request
    (malformed, or longer than the context) leave none; mode 0600."""
    from specdec.server.record import RequestLog
    from specdec.train.conversations import read_requests

    path = tmp_path / "traffic.jsonl"
    target, draft = _toy_models()
    service = build_service(target, draft, AUTO, 4, ("toy",), "toy-draft", record=RequestLog(path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "abc abc"}]
    with serving(service) as base:
        c = client(base)
        c.chat.completions.create(model="toy", messages=messages, max_tokens=4)
        list(c.completions.create(model="toy", prompt="hello world", max_tokens=4, stream=True))
        c.completions.create(model="toy", prompt=[5, 6, 7], max_tokens=4)  # token ids: no text to ask again
        with pytest.raises(openai.BadRequestError):  # refused: not traffic
            c.chat.completions.create(model="toy", messages=[], max_tokens=4)
        with pytest.raises(openai.BadRequestError):  # refused once read: longer than the context
            c.completions.create(model="toy", prompt="abc " * 4000, max_tokens=4)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"messages": messages},
        {"prompt": "hello world"},
    ]
    assert read_requests(path).chats == (
        (("system", "Be brief."), ("user", "abc abc")),
        (("user", "hello world"),),
    )
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_recorded_line_is_whole_or_absent(tmp_path, monkeypatch, caplog):
    """A write a full disk cuts short is cut off again, the request served all the same, and said
    once; the next request is recorded whole."""
    from specdec.server.record import RequestLog
    from specdec.train.conversations import read_requests

    path = tmp_path / "traffic.jsonl"
    record = RequestLog(path)
    record.add(None, "first")
    write = os.write
    with monkeypatch.context() as m:
        m.setattr(os, "write", lambda fd, data: write(fd, data[:5]))
        record.add([{"role": "user", "content": "second"}], None)
        record.add(None, "lost too")
    record.add(None, "third")
    record.close()
    assert list(read_requests(path).chats) == [(("user", "first"),), (("user", "third"),)]
    assert caplog.text.count("was not recorded") == 1 and record.lines == 2


def test_tokenize_and_detokenize_in_llama_servers_shapes():
    with toy_server(unique=True) as (base, service):
        tokenizer = service.worker.target.tokenizer
        r = httpx.post(base + "/tokenize", json={"content": "hello"})
        assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("hello", add_special=False)
        ids = r.json()["tokens"]
        pieces = httpx.post(base + "/tokenize", json={"content": "hello", "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == ids
        assert all(p["piece"] == tokenizer.token_bytes(p["id"]).decode() for p in pieces)
        back = httpx.post(base + "/detokenize", json={"tokens": ids}).json()
        assert back == {"content": tokenizer.decode(ids)}
        for path, body, param in (
            ("/tokenize", {"content": 5}, "content"),
            ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
            ("/detokenize", {"tokens": ["a"]}, "tokens"),
            ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ):
            bad = httpx.post(base + path, json=body)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, body, bad.text)
        # every answer names the build and the model
        chat = httpx.post(
            base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        )
        assert chat.json()["system_fingerprint"].startswith("specdec-") and chat.json()["system_fingerprint"].endswith(
            "-toy"
        )


def test_cors_preflight_and_headers_for_the_origins_given():
    target, draft = _toy_models()
    service = build_service(target, draft, AUTO, 2, ("toy",), "toy-draft", cors_origins=("http://localhost:3000",))
    with serving(service) as base:
        pre = httpx.options(
            base + "/v1/chat/completions",
            headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Origin": "http://localhost:3000"},
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Origin": "http://evil.example"},
        )
        assert "access-control-allow-origin" not in other.headers
