"""The engine's thread (server/worker.py) and the service rules: a client that disconnects frees its
row, a full queue is a 429, a time limit or an engine failure ends the request and not the server."""

from __future__ import annotations

import time

import pytest

from .helpers import (
    _stream_in_thread,
    _wait,
    httpx,
    metric,
    toy_server,
)


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
        # a non-streaming client that gives up is cancelled too (plain decoding: 200 steps of 20 ms;
        # `auto` on the toy's flat curve drafts trees that could answer within the client's 0.3 s)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                base + "/v1/completions",
                json={"prompt": "abc", "max_tokens": 200, "speculative": {"draft": "none"}},
                timeout=0.3,
            )
        _wait(lambda: not engine.rows and not engine.queue, 2, "the non-streaming row to be freed")
        assert service.inflight == 0


def test_a_full_queue_is_429_with_retry_after():
    with toy_server(delay=0.02, max_batch=1, max_queue=1) as (base, service):
        outs = [[], []]
        # plain decoding, 100 steps of 20 ms: both stay in the house while the third asks
        body = {"prompt": "abc", "max_tokens": 100, "speculative": {"draft": "none"}}
        threads = [_stream_in_thread(base, body, out) for out in outs]
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
        # plain decoding, 200 steps of 20 ms: well past the 0.3 s limit
        body = {"prompt": "abc", "max_tokens": 200, "speculative": {"draft": "none"}}
        r = httpx.post(base + "/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "time_limit"
        assert 0 < r.json()["usage"]["completion_tokens"] < 200
        service.worker.target.explode = True
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 5})
        assert r.status_code == 500 and "the toy backend failed" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("keeps", [True, False])
def test_a_row_whose_step_failed_is_neither_kept_nor_copied_to_host_memory(monkeypatch, keeps):
    """A step fails while a request decodes: its cache is no longer known, so its row is not kept
    for a later prompt (rows of their own) nor copied to host memory (one pool of cells, whose
    finished rows are copied out), while what finished before the failure stays."""
    from .helpers import SlowToy

    monkeypatch.setattr(SlowToy, "keeps_idle_rows", keeps, raising=False)
    with toy_server(delay=0.02) as (base, service):
        engine = service.worker.engine
        body = {"prompt": "abc", "max_tokens": 3, "speculative": {"draft": "none"}}
        assert httpx.post(base + "/v1/completions", json=body).status_code == 200
        assert engine.idle or engine.host.entries  # the first request's row kept, or its cache copied out
        out = []
        thread = _stream_in_thread(base, {**body, "prompt": "xyz", "max_tokens": 200}, out)
        _wait(lambda: len(out) >= 3, 10, "the stream to decode")
        [failing] = engine.rows.values()
        service.worker.target.explode = True
        thread.join(30)
        assert any("the toy backend failed" in str(event) for event in out), out[-2:]  # an error event
        _wait(lambda: not engine.rows, 10, "the failed row to go")
        start = tuple(failing.prompt_tokens)
        assert not engine.idle and engine.host.entries  # the first request's cache, copied out
        assert all(held[: len(start)] != start for held, _ in engine.host.entries.values())


def test_a_request_whose_time_ran_out_in_the_queue_is_answered_without_work():
    """One row, held by a long request: a second one waits in the queue past its time limit and is
    answered with time_limit and no tokens, its prompt never prefilled."""
    with toy_server(delay=0.02, max_batch=1) as (base, service):
        out = []
        thread = _stream_in_thread(base, {"prompt": "abc", "max_tokens": 200, "speculative": {"draft": "none"}}, out)
        _wait(lambda: len(out) >= 2, 10, "the first stream to start")
        service.request_timeout = 0.5  # the second request's limit; the first (about 4 s) has 600 s
        r = httpx.post(base + "/v1/completions", json={"prompt": "abd", "max_tokens": 5}, timeout=30)
        thread.join(30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "time_limit", r.text
        assert r.json()["usage"]["completion_tokens"] == 0


def test_prompts_are_tokenized_beside_the_engine_thread():
    """A long prompt's tokenization never stalls the running rows: it runs off the engine's thread."""
    import threading

    with toy_server() as (base, service):
        tokenizer = service.worker.target.tokenizer
        encode, threads = tokenizer.encode, []

        def recording(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return encode(*args, **kwargs)

        tokenizer.encode = recording
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert r.status_code == 200 and threads and "specdec-engine" not in threads, threads


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized():
    """A prompt of megabytes (under the 8 MiB body cap) is a 400 context_length_exceeded before
    the tokenizer sees it: the toy's tokens stand for a byte each, and its context holds 256."""
    with toy_server() as (base, service):
        tokenizer = service.worker.target.tokenizer
        encode, calls = tokenizer.encode, []

        def counting(text, *args, **kwargs):
            calls.append(len(text))
            return encode(text, *args, **kwargs)

        tokenizer.encode = counting
        huge = "abc " * (1 << 20)  # 4 MiB
        for path, body in (
            ("/v1/completions", {"prompt": huge, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}),
        ):
            r = httpx.post(base + path, json=body, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded" and "at least" in error["message"], error
        assert calls == []
        r = httpx.post(base + "/v1/completions", json={"prompt": "abc " * 60, "max_tokens": 2})
        assert r.status_code == 200 and calls == [240]  # one that fits: tokenized, served


def _first_forward(monkeypatch, gather, gap, n, gather_max=None, max_tokens=3):
    """Sends n requests `gap` seconds apart to an idle toy server (worker.GATHER and GATHER_MAX
    set as given); its first forward's rows: {row: (tokens fed, whether logits were asked)}."""
    from specdec.server import worker

    monkeypatch.setattr(worker, "GATHER", gather)
    if gather_max is not None:
        monkeypatch.setattr(worker, "GATHER_MAX", gather_max)
    with toy_server(delay=0.01) as (base, service):
        target = service.worker.target
        seen = []
        inner = target.forward_rows

        def forward_rows(tokens, n_logits=None):
            seen.append({row: (len(t), row in (n_logits or {})) for row, t in tokens.items()})
            return inner(tokens, n_logits)

        target.forward_rows = forward_rows
        outs = [[] for _ in range(n)]
        body = {"prompt": "abcdefgh", "max_tokens": max_tokens, "speculative": {"draft": "none"}}
        threads = []
        for out in outs:
            threads.append(_stream_in_thread(base, body, out))
            time.sleep(gap)
        for thread in threads:
            thread.join(30)
        assert [out[-1] for out in outs] == [("end", 200)] * n
        return seen[0]


def test_requests_arriving_together_start_together(monkeypatch):
    """An idle server woken by a request waits GATHER for others: two requests sent 50 ms apart
    (GATHER 0.5 s here, so that a slow machine cannot split them) prefill in ONE forward, so
    neither is decoding while the other's prompt rides in its steps."""
    first = _first_forward(monkeypatch, gather=0.5, gap=0.05, n=2, max_tokens=5)
    assert len(first) == 2 and not any(logits for _, logits in first.values())  # both prompts, together


def test_the_gathering_window_slides_with_each_arrival(monkeypatch):
    """Four requests 0.15 s apart, 0.6 s from first to last: each came within GATHER (0.5 s) of
    the one before, so all four prefill in the first forward, though the last came after
    GATHER from the first (a fixed window once missed the last of 8 clients)."""
    assert len(_first_forward(monkeypatch, gather=0.5, gather_max=5.0, gap=0.15, n=4)) == 4


def test_the_gathering_window_stops_at_gather_max(monkeypatch):
    """A stream of arrivals never holds the first request back longer than GATHER_MAX: requests
    0.8 s apart with GATHER_MAX 1.2 s, so the third is left to the next step. (0.4 s of slack
    either way: with 0.15 s a busy 2-core machine once let the second arrive after the window.)"""
    assert len(_first_forward(monkeypatch, gather=2.0, gather_max=1.2, gap=0.8, n=3)) == 2


def test_a_prompt_waiting_for_the_last_row_to_end_gathers_the_next_arrival(monkeypatch):
    """Two rows. A decodes; B comes while A decodes and waits (no prompt chunk rides in a decoding
    step here). When A ends, its client at once sends A2: B's prompt is read in one forward with
    A2's, so the two decode together, instead of A2 waiting behind B's prompt read alone (which
    kept two closed-loop clients from ever decoding together)."""
    from specdec.server import worker

    monkeypatch.setattr(worker, "GATHER", 0.5)  # wide, so that a slow machine cannot split them
    with toy_server(delay=0.01, max_batch=2) as (base, service):
        engine = service.worker.engine
        engine.costs, engine.prefill_chunk = None, 0  # no chunk beside a decoding row: B waits for A
        target = service.worker.target
        seen, inner = [], target.forward_rows

        def forward_rows(tokens, n_logits=None):
            seen.append(sorted(len(t) for row, t in tokens.items() if row not in (n_logits or {})))
            return inner(tokens, n_logits)

        target.forward_rows = forward_rows
        body = {"max_tokens": 20, "speculative": {"draft": "none"}}
        a, b, a2 = [], [], []
        first = _stream_in_thread(base, {**body, "prompt": "a" * 10, "max_tokens": 100}, a)
        _wait(lambda: len(a) >= 3, 10, "A to decode")
        second = _stream_in_thread(base, {**body, "prompt": "b" * 20}, b)
        _wait(lambda: engine.queue or len(engine.rows) == 2, 10, "B to come in")
        first.join(30)
        third = _stream_in_thread(base, {**body, "prompt": "c" * 30}, a2)  # A's client, at once
        for thread in (second, third):
            thread.join(30)
        assert [out[-1] for out in (a, b, a2)] == [("end", 200)] * 3
        prompts = [fed for fed in seen if fed]
        assert len(prompts) == 2 and len(prompts[1]) == 2, prompts  # A's prompt; then B's with A2's


@pytest.mark.parametrize("first, caught", [("cancel", ["cancel", "add"]), ("stop", ["stop"])])
def test_a_cancel_does_not_end_the_gathering_window_but_a_stop_does(monkeypatch, first, caught):
    """Every finished stream's handler sends a cancel (a no-op) as its client closes, just before
    that client's next request: the window goes on waiting for it (it once ended there, and two
    clients' requests were read one after the other). A stop ends it at once."""
    import queue
    import threading

    from specdec.server import worker

    monkeypatch.setattr(worker, "GATHER", 0.5)
    w = worker.Worker.__new__(worker.Worker)  # the loop's helper alone, without the engine thread
    w.inbox = queue.SimpleQueue()
    w.inbox.put((first, None))
    timer = threading.Timer(0.05, lambda: w.inbox.put(("add", None)))
    timer.start()
    commands = []
    w._gather(commands)
    timer.join()
    assert [kind for kind, _ in commands] == caught


@pytest.mark.parametrize("room, caught", [(1, ["add"]), (2, ["add", "add"]), (None, ["add", "add"])])
def test_the_gathering_window_ends_once_the_arrivals_fill_the_free_rows(monkeypatch, room, caught):
    """A request that could not join the step is not waited for: with one row free the window ends
    at the first arrival (a server of one row never waits), with two it takes a second that comes
    0.05 s later (GATHER 0.5 s)."""
    import queue
    import threading

    from specdec.server import worker

    monkeypatch.setattr(worker, "GATHER", 0.5)
    w = worker.Worker.__new__(worker.Worker)  # the loop's helper alone, without the engine thread
    w.inbox = queue.SimpleQueue()
    timer = threading.Timer(0.05, lambda: w.inbox.put(("add", None)))
    timer.start()
    commands = [("add", None)]
    w._gather(commands, room)
    timer.join()
    assert [kind for kind, _ in commands] == caught
