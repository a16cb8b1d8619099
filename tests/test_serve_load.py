"""benchmarks/serve_load.py reads what each server says of its drafts from its last streamed chunk:
specdec serve's "speculative", llama-server's "timings" (draft_n, draft_n_accepted), so the
comparison's acceptance column covers the peer's speculative configurations too."""

from __future__ import annotations

import argparse
import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "serve_load", Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
)
serve_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_load)


def _chunk(content=None, **extra) -> dict:
    choices = [{"index": 0, "delta": {"content": content}}] if content is not None else []
    return {"object": "chat.completion.chunk", "choices": choices, **extra}


def _serve(last: dict):
    """A server streaming three tokens, then `last`'s fields on the final chunk with usage."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            for event in (_chunk("a"), _chunk("b"), _chunk("c"), _chunk(usage=usage, **last)):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(
    "last, drafted, acceptance",
    [
        ({"speculative": {"drafted": 8, "accepted": 6}}, 16, 0.75),  # ours
        ({"timings": {"predicted_n": 3, "draft_n": 10, "draft_n_accepted": 4}}, 20, 0.4),  # llama-server's
        ({"timings": {"predicted_n": 3}}, 0, None),  # llama-server that drafted nothing
        ({}, 0, None),  # a server that says nothing of drafts
    ],
)
def test_a_servers_own_draft_counts_give_the_acceptance_column(last, drafted, acceptance):
    server = _serve(last)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        args = serve_load.main_args(["--url", url, "-n", "2", "--max-tokens", "3", "--label", "x"])
        row = serve_load.run_level(serve_load.base_url(args), ["p", "q"], 2, args)
    finally:
        server.shutdown()
    assert row["errors"] == [] and row["tokens"] == 6
    assert row["drafted"] == drafted
    assert row["acceptance"] == (pytest.approx(acceptance) if acceptance is not None else None)
    shown = serve_load.fmt(row).rstrip(" |").rsplit("| ", 1)[1]
    assert shown == ("-" if acceptance is None else f"{acceptance:.0%} of {drafted}")


def test_one_request_keeps_the_drafts_of_its_own_stream():
    server = _serve({"timings": {"draft_n": 7, "draft_n_accepted": 7}})
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        args = serve_load.main_args(["--url", url, "-n", "1", "--max-tokens", "3"])
        r = serve_load.one_request(serve_load.base_url(args), "p", argparse.Namespace(**vars(args)))
    finally:
        server.shutdown()
    assert r["tokens"] == 3 and len(r["itl"]) == 2
    assert r["speculative"] == {"drafted": 7, "accepted": 7}
