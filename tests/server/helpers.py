"""Shared by the server's tests: an in-process toy server, the real `specdec serve` as a process,
the OpenAI client, Prometheus samples, streams in threads."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ..conftest import require_module

require_module("fastapi", "the serve extra: pip install -e '.[serve]'")
httpx = require_module("httpx", "the serve extra: pip install -e '.[serve]'")
openai = require_module("openai", "the test extra: pip install -e '.[test]'")

import specdec  # noqa: E402
from specdec import GenerationConfig, SpeculativeDecoder  # noqa: E402
from specdec.server.app import AUTO, build_service, serve  # noqa: E402
from specdec.spec import DraftSpec  # noqa: E402

from ..toy import ToyLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SRC = Path(specdec.__file__).resolve().parents[2]


class SlowToy(ToyLM):
    """A toy target whose forwards take `delay` seconds (so a request lasts long enough to
    disconnect from, queue behind or time out), and that fails once when `explode` is set."""

    def __init__(self, *args, delay: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay, self.explode = delay, False

    def _slow(self):
        if self.explode:
            self.explode = False
            raise RuntimeError("the toy backend failed")
        if self.delay:
            time.sleep(self.delay)

    def forward_rows(self, tokens, n_logits=None):
        self._slow()
        return super().forward_rows(tokens, n_logits)

    def forward_tree_rows(self, trees):  # `auto` drafts trees on the toy's flat curve: as slow, as fragile
        self._slow()
        return super().forward_tree_rows(trees)


def _toy_models(delay: float = 0.0, unique: bool = False):
    target = SlowToy(seed=1, n_ctx=256, delay=delay)
    draft = ToyLM(seed=2, n_ctx=256, noise_from=target, noise=0.3)
    draft.name = "toy-draft"
    if unique:  # every token prints bytes of its own ("<7>"; the end token none), as a real vocabulary's
        tokenizer = target.tokenizer
        tokenizer._bytes = [b"" if t in tokenizer.eog_ids else f"<{t}>".encode() for t in range(target.vocab_size)]
        draft.tokenizer = tokenizer
    return target, draft


@contextlib.contextmanager
def toy_server(delay: float = 0.0, policy: DraftSpec = AUTO, max_batch: int = 4, unique: bool = False, **limits):
    """An in-process server on an ephemeral 127.0.0.1 port; yields (base URL, service). `unique`:
    every token prints bytes of its own (the toy's letters repeat past 26), so a client that knows
    tokens by their bytes (OpenAI's logprobs) tells every token apart."""
    target, draft = _toy_models(delay, unique)
    service = build_service(target, draft, policy, max_batch, ("toy",), "toy-draft", **limits)
    with serving(service) as base:
        yield base, service


@contextlib.contextmanager
def serving(service):
    """`service` served in-process on an ephemeral 127.0.0.1 port; yields the base URL."""
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
        yield base
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
    assert delta("specdec:prefix_cache_hits_total") == sum(
        b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies
    )
    assert delta("specdec:time_to_first_token_seconds_count") == len(bodies)
    assert metric(after, "specdec:num_requests_running") == 0 == metric(after, "specdec:num_requests_waiting")
