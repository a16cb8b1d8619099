"""`specdec serve`: the OpenAI API over the engine, with continuous batching.

    protocol.py   request bodies -> Job (validated), results -> response bodies (pure)
    policy.py     RoutingController: each request its own speculation, all rows in one step
    worker.py     the one thread that owns the engine; commands in, text out
    metrics.py    Prometheus metrics under vLLM's names (specdec: for vllm:)
    record.py     --record-requests: each admitted request's prompt, a JSON line for `specdec train --requests`
    app.py        FastAPI routes, limits, auth, draining; build_service and serve

FastAPI, uvicorn and prometheus-client are the `serve` extra: nothing here is imported unless
the server runs.
"""
