"""The server's process: a signal drains the running and the queued requests, a second one exits at
once, and `specdec serve`'s flags are checked before any model loads."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from .helpers import (
    ROOT,
    SRC,
    _stream_in_thread,
    _wait,
    _wait_healthy,
    httpx,
    metric,
)

DRAIN_SCRIPT = """
import socket, sys
from tests.server.helpers import _toy_models
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
    process exits with 128 + the signal's number, and the stream ends unfinished, told so by an
    error event (then [DONE]), not cut without a word."""
    with drain_server() as (proc, base):
        out = []
        thread = _stream_in_thread(base, {"prompt": "abc", "max_tokens": 240, "speculative": {"draft": "none"}}, out)
        _wait(lambda: len(out) >= 2, 10, "the stream to start")
        proc.send_signal(sig)
        _wait(lambda: httpx.get(base + "/health").status_code == 503, 5, "draining")
        proc.send_signal(sig)
        assert proc.wait(20) == 128 + sig
        thread.join(20)
        assert out[-1] == ("end", 200), out[-3:]  # the stream ended in order, with [DONE]
        kind, last = out[-2]
        assert kind == "chunk" and last["error"]["code"] == "shutting_down", out[-3:]
        assert sum("choices" in chunk for kind, chunk in out if kind == "chunk") < 240


def test_serve_flags_are_checked_before_loading():
    from ..test_user_errors import assert_user_error, specdec

    assert_user_error(specdec("serve", "--port", "70000"), "--port")
    assert_user_error(specdec("serve", "--max-batch", "0"), "--max-batch")
    assert_user_error(specdec("serve", "--draft", "early-exit:3"), "needs --backend numpy")
    assert_user_error(specdec("serve", "--target", "gpt-17"), "unknown model 'gpt-17'")


def test_port_0_reports_the_port_it_bound():
    """`--port 0` picks a free port; the banner (on_listening) names that port, not 0."""
    import threading

    from specdec.server.app import build_service, serve

    from .helpers import _toy_models

    target, draft = _toy_models()
    service = build_service(target, draft, model_names=("toy",))
    ports, servers = [], []
    thread = threading.Thread(
        target=serve,
        args=(service, "127.0.0.1", 0),
        kwargs=dict(log_level="warning", on_ready=servers.append, on_listening=ports.append),
        daemon=True,
    )
    thread.start()
    _wait(lambda: bool(ports), 30, "the server to listen")
    try:
        assert ports[0] != 0
        assert httpx.get(f"http://127.0.0.1:{ports[0]}/health").status_code == 200
    finally:
        servers[0].should_exit = True
        thread.join(15)
