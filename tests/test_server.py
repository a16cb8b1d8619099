"""`specdec serve`: the OpenAI API, service rules, metrics; toy models in-process where the model is
not the point, the real 1.5B target (and the real `specdec serve` command) where it is."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .conftest import require_module  # noqa: E402

require_module("fastapi", "the serve extra: pip install 'specdec[serve]'")
httpx = require_module("httpx", "the serve extra: pip install 'specdec[serve]'")
openai = require_module("openai", "the test extra: pip install 'specdec[test]'")

import specdec  # noqa: E402
from specdec import GenerationConfig, SpeculativeDecoder  # noqa: E402
from specdec.server.app import AUTO, build_service, serve  # noqa: E402
from specdec.spec import DraftSpec  # noqa: E402

from .lossless import assert_greedy_lossless  # noqa: E402
from .toy import ToyLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(specdec.__file__).resolve().parents[1]


class SlowToy(ToyLM):
    """A toy target whose forwards take `delay` seconds (so a request lasts long enough to
    disconnect from, queue behind or time out), and that fails once when `explode` is set."""

    def __init__(self, *args, delay: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay, self.explode = delay, False

    def forward_rows(self, tokens, n_logits=None):
        if self.explode:
            self.explode = False
            raise RuntimeError("the toy backend failed")
        if self.delay:
            time.sleep(self.delay)
        return super().forward_rows(tokens, n_logits)


def _toy_models(delay: float = 0.0):
    target = SlowToy(seed=1, n_ctx=256, delay=delay)
    draft = ToyLM(seed=2, n_ctx=256, noise_from=target, noise=0.3)
    draft.name = "toy-draft"
    return target, draft


@contextlib.contextmanager
def toy_server(delay: float = 0.0, policy: DraftSpec = AUTO, max_batch: int = 4, **limits):
    """An in-process server on an ephemeral 127.0.0.1 port; yields (base URL, service)."""
    target, draft = _toy_models(delay)
    service = build_service(target, draft, policy, max_batch, ("toy",), "toy-draft", **limits)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    servers = []
    thread = threading.Thread(
        target=serve,
        args=(service,),
        daemon=True,
        kwargs=dict(sockets=[sock], log_level="warning", on_ready=servers.append),
    )
    thread.start()
    _wait_healthy(base, 30)
    try:
        yield base, service
    finally:
        servers[0].should_exit = True
        thread.join(15)
        assert not thread.is_alive()


def _wait_healthy(base: str, timeout: float, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {proc.stderr.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"{base} did not come up in {timeout} s")


def client(base: str, key: str = "none") -> "openai.OpenAI":
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def metric(text: str, name: str, **labels) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            have = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(have.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def reference(target: ToyLM, text: str, chat: bool, n: int) -> str:
    """The toy target's own greedy output (plain decoding, no server)."""
    decoder = SpeculativeDecoder(target, None)
    return decoder.generate(text, GenerationConfig(max_new_tokens=n, chat=chat)).text


# -- the API, with the real OpenAI client --------------------------------------------------------


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


BAD = [
    (b"{", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"prompt": "x", "n": 2}, "only n = 1"),
    ({"prompt": "x", "logprobs": 3}, "logprobs are not supported"),
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
    ({"prompt": "x", "speculative": {"draft": "ngram", "k": 0}}, "'k' must be in [1, 32]"),
    ({"prompt": "x", "speculative": {"draft": "auto", "k": 4}}, "chooses k itself"),
    ({"prompt": "x", "speculative": {"model": "a.gguf"}}, "unknown field(s) model"),
    ({"prompt": ""}, "'prompt' is empty"),
    ({"prompt": ["a", "b"]}, "several prompts"),
    ({"prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ({"prompt": "x" * 300}, "the context holds 256"),
    ({"prompt": "x" * 200, "max_tokens": 100}, "at most 56 fit"),
    ({}, "'prompt' must be"),
]

BAD_CHAT = [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tools are not supported"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "only text parts",
    ),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "unsupported field(s) name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
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
                "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}]}],
                "n": 1,
                "logprobs": False,
                "tools": [],
                "presence_penalty": 0,
                "max_completion_tokens": 3,
                "stop": "zzz",
                "top_k": -1,
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.get(base + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = httpx.get(base + "/v1/completions")
        assert r.status_code == 405 and "error" in r.json()


def test_api_key():
    with toy_server(api_key="s3cret") as (base, _):
        body = {"prompt": "ab", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(base + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(base + "/v1/models").status_code == 401
        assert client(base, "s3cret").completions.create(model="toy", prompt="ab", max_tokens=2).usage
        assert httpx.get(base + "/health").status_code == 200  # probes need no key


# -- service behaviour ----------------------------------------------------------------------------


def _stream_in_thread(base: str, body: dict, out: list, chunks_before_close: int | None = None):
    """Stream a completion in a thread; `out` gets ("chunk", text) events and then ("end", status)."""

    def run():
        try:
            with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                if r.status_code != 200:
                    out.append(("end", r.status_code))
                    return
                n = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        out.append(("chunk", json.loads(line[6:])))
                        n += 1
                        if chunks_before_close is not None and n >= chunks_before_close:
                            out.append(("end", "closed"))
                            return  # leaving the block closes the connection
                out.append(("end", 200))
        except Exception as exc:  # surfaced by the assertions on `out`
            out.append(("end", repr(exc)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_a_client_that_disconnects_frees_its_row():
    # one row; each step 20 ms: the first request alone would hold the row for 4 s
    with toy_server(delay=0.02, max_batch=1) as (base, service):
        engine = service.worker.engine
        out = []
        thread = _stream_in_thread(
            base, {"prompt": "abc", "max_tokens": 200, "speculative": {"draft": "none"}}, out, chunks_before_close=3
        )
        thread.join(10)
        assert out[-1] == ("end", "closed")
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": "abc", "max_tokens": 5, "speculative": {"draft": "none"}},
            timeout=10,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        _wait(lambda: not engine.rows and not engine.queue, 2, "the engine to be empty")
        metrics = httpx.get(base + "/metrics").text
        assert metric(metrics, "specdec:request_success_total", finished_reason="abort") == 1
        # the abandoned request was cut where its client left, not run to its 200 tokens first
        # (on one row, the next request would have waited for that)
        assert metric(metrics, "specdec:generation_tokens_total") < 200
        # a non-streaming client that gives up is cancelled too
        with pytest.raises(httpx.TimeoutException):
            httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 200}, timeout=0.3)
        _wait(lambda: not engine.rows and not engine.queue, 2, "the non-streaming row to be freed")
        assert service.inflight == 0


def test_a_full_queue_is_429_with_retry_after():
    with toy_server(delay=0.02, max_batch=1, max_queue=1) as (base, service):
        outs = [[], []]
        threads = [_stream_in_thread(base, {"prompt": "abc", "max_tokens": 40}, out) for out in outs]
        _wait(lambda: service.inflight == 2, 5, "two requests in the house")
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        for thread in threads:
            thread.join(30)
        assert [out[-1] for out in outs] == [("end", 200)] * 2
        assert httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
        assert metric(httpx.get(base + "/metrics").text, "specdec:request_rejected_total", status="429") == 1


def test_time_limit_and_engine_failures_do_not_end_the_server():
    with toy_server(delay=0.02, request_timeout=0.3) as (base, service):
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 200})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "time_limit"
        assert 0 < r.json()["usage"]["completion_tokens"] < 200
        service.worker.target.explode = True
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 5})
        assert r.status_code == 500 and "the toy backend failed" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_metrics_equal_the_sums_of_the_responses():
    with toy_server(max_batch=2) as (base, _):
        results = [None] * 5

        def one(i):
            results[i] = httpx.post(
                base + "/v1/completions",
                timeout=30,
                json={
                    "prompt": "abcabc" * (i + 1),
                    "max_tokens": 10 + 3 * i,
                    "speculative": [{"draft": "auto"}, {"draft": "ngram", "k": 2}, {"draft": "toy-draft", "k": 3}][
                        i % 3
                    ],
                },
            ).json()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        _check_metrics(httpx.get(base + "/metrics").text, results, before="")


def _check_metrics(after: str, bodies: list[dict], before: str) -> None:
    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    spec = [b["speculative"] for b in bodies]
    assert delta("specdec:spec_decode_num_drafts_total") == sum(s["num_drafts"] for s in spec)
    assert delta("specdec:spec_decode_num_draft_tokens_total") == sum(s["drafted"] for s in spec)
    assert delta("specdec:spec_decode_num_accepted_tokens_total") == sum(s["accepted"] for s in spec)
    for pos in range(max(len(s["accepted_by_position"]) for s in spec)):
        assert delta("specdec:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == sum(
            s["accepted_by_position"][pos] for s in spec if pos < len(s["accepted_by_position"])
        )
    assert delta("specdec:generation_tokens_total") == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert delta("specdec:prompt_tokens_total") == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert delta("specdec:time_to_first_token_seconds_count") == len(bodies)
    assert metric(after, "specdec:num_requests_running") == 0 == metric(after, "specdec:num_requests_waiting")


DRAIN_SCRIPT = """
import socket, sys
from tests.test_server import _toy_models
from specdec.server.app import build_service, serve
target, draft = _toy_models(delay=0.02)
service = build_service(target, draft, max_batch=1, model_names=("toy",))
sock = socket.socket(); sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
code = serve(service, sockets=[sock], log_level="warning")
print("exited with", code, flush=True)
sys.exit(code)
"""


@contextlib.contextmanager
def drain_server():
    """The toy server of DRAIN_SCRIPT in its own process, one row: yields (process, base URL)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(ROOT)]), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", DRAIN_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        base = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        _wait_healthy(base, 30, proc)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_running_and_the_queued_requests(sig):
    with drain_server() as (proc, base):
        running, queued = [], []
        threads = [
            _stream_in_thread(base, {"prompt": "abc", "max_tokens": 60, "speculative": {"draft": "none"}}, running)
        ]
        _wait(lambda: len(running) >= 2, 10, "the stream to start")
        threads.append(_stream_in_thread(base, {"prompt": "abd", "max_tokens": 20}, queued))  # one row: waits
        _wait(
            lambda: metric(httpx.get(base + "/metrics").text, "specdec:num_requests_waiting") == 1,
            10,
            "the second request to queue",
        )
        proc.send_signal(sig)
        _wait(lambda: httpx.get(base + "/health").status_code == 503, 5, "draining")
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        for thread in threads:
            thread.join(30)
        for out, n in ((running, 60), (queued, 20)):  # in flight and in the queue: both finished
            assert out[-1] == ("end", 200)
            assert out[-2][1]["usage"]["completion_tokens"] == n
            assert "".join(c["choices"][0]["text"] for kind, c in out if kind == "chunk")
        assert proc.wait(20) == 0
        assert "exited with 0" in proc.stdout.read()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_exits_at_once_with_its_code(sig):
    """A drain that would take 5 s (240 tokens at 20 ms) is cut short by a second signal: the
    process exits with 128 + the signal's number, and the stream ends unfinished."""
    with drain_server() as (proc, base):
        out = []
        thread = _stream_in_thread(base, {"prompt": "abc", "max_tokens": 240, "speculative": {"draft": "none"}}, out)
        _wait(lambda: len(out) >= 2, 10, "the stream to start")
        proc.send_signal(sig)
        _wait(lambda: httpx.get(base + "/health").status_code == 503, 5, "draining")
        proc.send_signal(sig)
        assert proc.wait(20) == 128 + sig
        thread.join(20)
        assert out[-1] != ("end", 200)
        assert sum(kind == "chunk" for kind, _ in out) < 240


def test_serve_flags_are_checked_before_loading():
    from .test_user_errors import assert_user_error, specdec

    assert_user_error(specdec("serve", "--port", "70000"), "--port")
    assert_user_error(specdec("serve", "--max-batch", "0"), "--max-batch")
    assert_user_error(specdec("serve", "--draft", "early-exit:3"), "needs --backend numpy")
    assert_user_error(specdec("serve", "--target", "gpt-17"), "unknown model 'gpt-17'")


# -- the real 1.5B target through `specdec serve` --------------------------------------------------

REAL_TOKENS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_process(*flags: str) -> tuple[subprocess.Popen, str]:
    """`specdec serve FLAGS` on a free loopback port: the process and its base URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", *flags, "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def real_server(target_model):  # target_model: skips (or fails) without the real models
    proc, base = _serve_process("--max-batch", "4", "--ctx", "2048")
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
    proc, base = _serve_process(
        "--target", "qwen2.5-coder-0.5b", "--draft", "suffix", "--suffix-cache", str(cache), "--max-batch", "1",
        "--ctx", "1024",
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


def _suite_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "benchmarks" / "prompts.jsonl").read_text().splitlines() if line]
    short = [r["prompt"] for r in rows if r["category"] in ("chat", "math")]
    return short[:n]


def _generate(prompt: str, *flags) -> dict:
    from .test_user_errors import specdec as run_cli

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
