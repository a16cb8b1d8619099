"""Prometheus metrics (server/metrics.py): the counters equal the sums of the responses."""

from __future__ import annotations

import threading

from .helpers import (
    _check_metrics,
    httpx,
    toy_server,
)


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
