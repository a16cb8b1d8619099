"""HTTP: the OpenAI API on FastAPI, and the service rules around it.

The rules: a bounded number of requests in the house (rows + queue; past it, 429 with
Retry-After); every request has a time limit, and so have its headers and its body on the wire
(a client that trickles them holds a socket for a bounded time); a client that goes away has its
row cancelled within one step; `--api-key` guards /v1/*; SIGTERM (or Ctrl-C) drains -- new
requests get 503, the ones in flight finish, then the process exits 0 (a second signal exits at
once, with 128 + its number: 130 for Ctrl-C, and tells the requests it cuts so: an error event,
or a 503). Nothing a request sends can end the server: every failure is an OpenAI-style error
body.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
from dataclasses import replace

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..controller import LONG_STEP_SHARE, SERVER_OBJECTIVE
from ..engine import HOST_CACHE_MIB, PREFILL_STALL, PREFILL_WASTE, Engine
from ..errors import FieldError, SpecdecError
from ..request import prepare
from ..spec import DraftSpec
from ..tools import held_back
from .metrics import Metrics
from .policy import RoutingController
from .protocol import (
    Job,
    RequestError,
    chunk_body,
    error_body,
    fingerprint,
    new_id,
    now,
    parse_chat,
    parse_completion,
    response_body,
    speculative_body,
    tool_call_chunks,
    tool_calls,
    usage_body,
)
from .record import RequestLog
from .worker import Handle, Worker

log = logging.getLogger("specdec.server")

MAX_BODY = 8 << 20  # bytes of a request body; a prompt that needs more exceeds any context
RETRY_AFTER = 1  # seconds a 429 / 503 asks the client to wait
CUT_GRACE = 1.0  # seconds a second signal waits for the requests it cut to be told so
MAX_CONNECTIONS = 256  # the least number of open connections served at once (4 x rows + queue where more)
BODY_TIMEOUT = 30.0  # seconds a request body may take to arrive (a slow client holds no row, but a socket)
# seconds a request's headers may take to arrive, from the connection's start or the end of the
# response before: headers are small (h11 refuses more than 16 KiB), so a third of the body's time
HEADER_TIMEOUT = 10.0


class Service:
    """The models, the engine's worker, and the limits: what the HTTP routes call."""

    def __init__(
        self,
        engine: Engine,
        router: RoutingController,
        model_names: tuple[str, ...],
        draft_names: dict[str, str],
        default_policy: DraftSpec,
        max_queue: int = 64,
        request_timeout: float = 600.0,
        api_key: str | None = None,
        special_in_turns: bool = False,
        reproducible: bool = False,
        record: RequestLog | None = None,
        cors_origins: tuple[str, ...] = (),
    ):
        self.model_names, self.draft_names = model_names, draft_names
        self.cors_origins = tuple(cors_origins)  # browsers' origins that may call (--cors-origins)
        self.record = record  # --record-requests: each accepted request's prompt, for `specdec train --requests`
        self.default_policy = default_policy
        self.max_batch = engine.max_rows
        self.capacity = engine.max_rows + max_queue  # requests in the house at once
        self.request_timeout = request_timeout
        self.api_key = api_key
        # special tokens spelled in a chat message become control tokens (`--special-in-turns`):
        # the server's choice for every request, never a request's own
        self.special_in_turns = special_in_turns
        self.reproducible = reproducible  # sampling by position (GenerationConfig.reproducible), server-wide
        self.n_ctx = engine.target.n_ctx
        # whether a forward scores a tree (models.base): a request's own tree needs it
        self.scores_trees = engine.target.scores_trees
        if default_policy.width > 1 and not self.scores_trees:
            raise ValueError("a default policy that drafts trees needs a target that scores them (trees=True)")
        self.metrics = Metrics(model_names[0])
        self.worker = Worker(engine, router, self.metrics)
        self.inflight = 0  # requests accepted and not yet answered
        self.preparing = anyio.CapacityLimiter(1)  # requests being tokenized at once
        self.body_timeout = BODY_TIMEOUT
        self.header_timeout = HEADER_TIMEOUT  # read by each connection as its clock starts
        self.draining = False
        self.started = int(time.time())

    @property
    def idle(self) -> bool:
        return self.inflight == 0

    def prepare(self, job: Job):
        """The request's prompt tokens and final config (request.prepare: chat turns through the
        chat template, a completion's text raw), checked against the context; called off the
        engine's thread, so that tokenizing a long prompt never stalls the running rows."""
        chat = job.kind == "chat"
        config = replace(job.config, chat=chat, special_in_turns=self.special_in_turns, reproducible=self.reproducible)
        try:
            prepared = prepare(
                self.worker.target, job.prompt, config, messages=job.messages if chat else None, limit=job.limit
            )
            if config.constraint is not None:  # compiled here (cached), so the engine's add copies it
                self.worker.engine.grammars.constraint(config.constraint)
            return prepared
        except FieldError as exc:
            raise RequestError(str(exc), exc.param, exc.code) from None
        except SpecdecError as exc:  # e.g. a model without a chat template
            raise RequestError(str(exc)) from None

    def close(self) -> None:
        self.worker.stop()
        if self.record is not None:
            self.record.close()


AUTO = DraftSpec("auto", k=0)  # the server's default policy


def build_service(
    target,
    draft_model=None,
    default_policy: DraftSpec = AUTO,
    max_batch: int = 4,
    model_names: tuple[str, ...] = (),
    draft_name: str | None = None,
    suffix=None,
    head=None,
    prefill_stall: float = PREFILL_STALL,
    prefill_waste: float = PREFILL_WASTE,
    prefix_cache: bool = True,
    host_cache: int | None = HOST_CACHE_MIB << 20,
    objective: str = SERVER_OBJECTIVE,
    long_step_share: float = LONG_STEP_SHARE,
    costs: tuple | None = None,
    **limits,
) -> Service:
    """A service over loaded models: `target`, and `draft_model` (a RowModel, of another vocabulary
    too, or a Drafter such as drafters.model_drafter's, or None) for the 'auto' policy and for
    requests that name it (`draft_name`).
    The cost-aware controller is built (its cost curves `costs`, as controller.auto_controller takes
    them, else measured or read from the cache) even when the default policy is fixed, since any
    request may ask for 'auto'. `suffix` is the suffix
    cache (as SpeculativeDecoder takes it): ONE for every request, whatever its policy, so each
    request drafts from all the requests before it. `head` is a trained head's drafter
    (drafters.head), which requests name as 'head'. `prefill_stall`: a step that carries joining
    requests' prompt chunks costs at most this many plain steps of the decoding rows, and a chunk
    rides only where its tokens cost at most `prefill_waste` times what they cost read alone (Engine).
    `prefix_cache`: finished requests' rows keep their caches for prompts that start the same way
    (Engine; where the target keeps idle rows for free), and with `host_cache` bytes of host
    memory (None: no limit, 0: none) a kept row's cache outlives its row (Engine, HOST_CACHE_MIB).
    `objective`: what 'auto' maximises over the batch (controller.OBJECTIVES): the batch's tokens
    per second with no step past LATENCY_STEP plain steps ("bounded", SERVER_OBJECTIVE), each
    request's own under the same bound ("latency"), or the batch's unbounded ("throughput").
    `long_step_share`: under "bounded", the share of steps that may pass the bound for a long,
    sure draft (controller.LONG_STEP_SHARE)."""
    from ..build import Drafters, cost_aware, pool

    ngram, suffix, model = pool(target, draft_model, suffix)
    drafters = Drafters(default_policy, ngram=ngram, suffix=suffix, model=model, head=head)
    router = RoutingController(
        cost_aware(target, drafters, costs, objective=objective, long_step_share=long_step_share), drafters
    )
    engine = Engine(
        target,
        router,
        drafters.all(),  # a head may be auto's too
        max_rows=max_batch,
        costs=router.auto.target_cost,
        prefill_stall=prefill_stall,
        prefill_waste=prefill_waste,
        prefix_cache=prefix_cache,
        host_cache=host_cache,
    )
    draft_names = {"auto": "auto", "ngram": "ngram", "none": "none"}
    if suffix is not None:
        draft_names["suffix"] = "suffix"
    if head is not None:
        draft_names["head"] = "head"
    if draft_model is not None:
        for name in (draft_name, draft_model.name):
            if name:
                draft_names[name] = "model"
    if default_policy.kind == "model" and draft_model is None:
        raise ValueError("a 'model' default policy needs a draft model")
    if default_policy.kind == "head" and head is None:
        raise ValueError("a 'head' default policy needs a head")
    return Service(engine, router, model_names or (target.name,), draft_names, default_policy, **limits)


# -- the app ----------------------------------------------------------------------------------------


def _check_strings(value) -> None:
    """JSON may escape a lone UTF-16 surrogate (\\ud800), which no UTF-8 text holds: refuse it
    here, in a value or a key, rather than fail later where the text is encoded. Iterative: the
    body may nest as deep as the JSON parser allows."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(
                    "the request body holds a lone UTF-16 surrogate escape (such as \\ud800), which is not text",
                    code="invalid_json",
                ) from None


def _error(exc: RequestError, metrics: Metrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.rejected(exc.status)
    headers = {"Retry-After": str(RETRY_AFTER)} if exc.status in (429, 503) else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that end the moment the client goes away: the stream runs beside a
    watch on the connection (whatever ASGI version the server speaks), and `on_close` runs
    whichever way it ends (even if the stream never started), so the request's row is cancelled
    within one step."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self.on_close()


def create_app(service: Service) -> FastAPI:
    """The OpenAI-compatible app over `service` (on app.state, where each route below reads it)."""
    app = FastAPI(title="specdec", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.service = service
    app.openapi = lambda: _openapi(app)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    if service.cors_origins:  # a browser's preflight (OPTIONS) and its answers' Access-Control headers
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(service.cors_origins),
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", prometheus, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    return app


def _openapi(app: FastAPI) -> dict:
    """The OpenAPI document, with the request bodies the two completion routes read (schema.py):
    they read their JSON themselves (size, time and surrogate limits: read_json), so FastAPI does
    not see a body parameter to describe."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        from .. import __version__
        from .schema import ChatRequest, CompletionRequest

        schema = get_openapi(title="specdec", version=__version__, routes=app.routes)
        models = [(ChatRequest, "validation"), (CompletionRequest, "validation")]
        _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        for path, model in (("/v1/chat/completions", ChatRequest), ("/v1/completions", CompletionRequest)):
            body = {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": body}}
        app.openapi_schema = schema
    return app.openapi_schema


def _service(request: Request) -> Service:
    return request.app.state.service


# -- errors -----------------------------------------------------------------------------------------


async def _request_error(request: Request, exc: RequestError):
    return _error(exc, _service(request).metrics)


async def _http_error(request: Request, exc: StarletteHTTPException):
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(error_body(message, kind), status_code=exc.status_code)


async def _internal(request: Request, exc: Exception):  # never expected: a bug, not a crash
    log.exception("unhandled error")
    _service(request).metrics.rejected(500)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


def check_auth(service: Service, request: Request) -> None:
    if service.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), service.api_key.encode()):
        raise RequestError(
            "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            status=401,
            type="authentication_error",
        )


async def read_json(service: Service, request: Request):
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise RequestError(f"the request body is larger than {MAX_BODY} bytes", status=413)
    body = b""
    with anyio.move_on_after(service.body_timeout) as scope:
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY:
                raise RequestError(f"the request body is larger than {MAX_BODY} bytes", status=413)
    if scope.cancelled_caught:
        raise RequestError(
            f"the request body took more than {service.body_timeout:g} s to arrive", code="timeout", status=408
        )
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("the request body nests too deeply", code="invalid_json") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise RequestError(f"the request body has a number out of range: {exc}", code="invalid_json") from None
    _check_strings(value)
    return value


# -- routes -----------------------------------------------------------------------------------------


async def health(request: Request):
    if _service(request).draining:
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER)})
    return {"status": "ok"}


async def prometheus(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_service(request).metrics.text(), media_type=CONTENT_TYPE_LATEST)


async def tokenize(request: Request):
    """llama-server's POST /tokenize: {"content", "add_special" (false), "parse_special" (true),
    "with_pieces" (false)} -> {"tokens": [id, ...]}, or with pieces [{"id", "piece"}] (a piece
    that is not whole UTF-8: its bytes)."""
    service = _service(request)
    check_auth(service, request)
    body = await read_json(service, request)
    content = body.get("content") if isinstance(body, dict) else None
    if not isinstance(content, str):
        raise RequestError("'content' must be a string", "content")
    flags = {
        name: body.get(name, default)
        for name, default in (("add_special", False), ("parse_special", True), ("with_pieces", False))
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise RequestError(f"'{name}' must be true or false, got {value!r}", name)
    tokenizer = service.worker.target.tokenizer
    ids = await anyio.to_thread.run_sync(
        lambda: tokenizer.encode(content, add_special=flags["add_special"], special=flags["parse_special"]),
        limiter=service.preparing,
    )
    if not flags["with_pieces"]:
        return {"tokens": ids}
    pieces = []
    for i in ids:
        raw = tokenizer.token_bytes(i)
        try:
            piece = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": i, "piece": piece})
    return {"tokens": pieces}


async def detokenize(request: Request):
    """llama-server's POST /detokenize: {"tokens": [id, ...]} -> {"content"}."""
    service = _service(request)
    check_auth(service, request)
    body = await read_json(service, request)
    ids = body.get("tokens") if isinstance(body, dict) else None
    vocab = service.worker.target.vocab_size
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise RequestError("'tokens' must be a list of token ids", "tokens")
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
    return {"content": service.worker.target.tokenizer.decode(ids)}


def model_card(service: Service, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": service.started,
        "owned_by": "specdec",
        "max_model_len": service.n_ctx,
    }


async def models(request: Request):
    service = _service(request)
    check_auth(service, request)
    return {"object": "list", "data": [model_card(service, name) for name in service.model_names[:1]]}


async def model(name: str, request: Request):
    service = _service(request)
    check_auth(service, request)
    if name not in service.model_names:
        raise RequestError(
            f"model {name!r} is not served here; this server serves {service.model_names[0]!r}",
            "model",
            "model_not_found",
            status=404,
            type="not_found_error",
        )
    return model_card(service, name)


async def chat(request: Request):
    return await generate(request, parse_chat)


async def completions(request: Request):
    return await generate(request, parse_completion)


async def generate(request: Request, parse):
    """A completion or chat request: read, checked, tokenized off the engine's thread, handed to the
    worker, and answered whole or as a stream of server-sent events."""
    service = _service(request)
    if service.draining:
        raise RequestError(
            "the server is shutting down; retry on another replica",
            code="shutting_down",
            status=503,
            type="unavailable_error",
        )
    check_auth(service, request)
    job: Job = parse(await read_json(service, request), service.model_names, service.draft_names)
    if job.policy is not None and job.policy.width > 1 and not service.scores_trees:
        raise RequestError(
            f"'speculative.width' {job.policy.width}: this server's target scores chains only "
            "(start it with a tree, e.g. --draft suffix --draft-width 4, to serve trees)",
            "speculative.width",
        )
    if service.inflight >= service.capacity:
        raise RequestError(
            f"the server is full ({service.max_batch} running and the queue of "
            f"{service.capacity - service.max_batch} waiting); retry later",
            code="queue_full",
            status=429,
            type="rate_limit_error",
        )
    loop = asyncio.get_running_loop()
    handle = Handle(
        job,
        job.policy or service.default_policy,
        loop,
        asyncio.Queue(),
        deadline=time.monotonic() + service.request_timeout,
    )
    service.inflight += 1
    handle.closed = True  # until the worker has it: nothing to cancel
    released = False

    def release():
        """Once per request: it leaves the house; if the worker still runs it, it is cancelled."""
        nonlocal released
        if not released:
            released = True
            service.inflight -= 1
            if not handle.closed:
                service.worker.cancel(handle)

    streaming = False
    try:
        # tokenized here, one request at a time, beside the engine's thread (not on it)
        handle.tokens, handle.config = await anyio.to_thread.run_sync(service.prepare, job, limiter=service.preparing)
        handle.closed = False
        service.worker.submit(handle)
        event = await handle.events.get()  # admitted, or refused (context, token ids)
        if event[0] == "error":
            raise event[1]
        if service.record is not None:  # admitted: what its user asked is traffic to train on
            service.record.add(job.messages, job.prompt)
        if job.stream:
            streaming = True
            return _EventStream(
                _stream(handle, service),
                release,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(request, handle, service)
    finally:
        if not streaming:
            release()


async def _complete(request: Request, handle: Handle, service: Service):
    """Wait for the whole text, watching the connection: a client that leaves is cancelled."""
    pieces, outcome = [], {}

    async def watch(scope):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                outcome["gone"] = True
                scope.cancel()
                return

    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        while True:
            event = await handle.events.get()
            if event[0] == "text":
                pieces.append(event[1])
                continue
            outcome["event"] = event
            group.cancel_scope.cancel()
            break
    if "event" not in outcome:
        return Response(status_code=499)  # nobody is listening
    event = outcome["event"]
    if event[0] == "error":
        raise event[1]
    _, result, finish = event
    job = handle.job
    return response_body(
        job,
        new_id(job.kind),
        now(),
        result.text,
        result.tokens,
        finish,
        result.stats,
        handle.policy,
        result.logprobs,
        service.worker.target.tokenizer.token_bytes,
    )


async def _stream(handle: Handle, service: Service):
    job = handle.job
    token_bytes = service.worker.target.tokenizer.token_bytes
    id, created = new_id(job.kind), now()
    calling = job.kind == "chat" and job.config.tool_choice_word != "none"
    text, sent = "", 0  # with tools: the text so far, and how much of it went out as content
    if job.kind == "chat":
        yield _sse(chunk_body(job, id, created, role=True))
    while True:
        event = await handle.events.get()
        if event[0] == "text" and calling:  # content up to a call's opening; the calls at the end
            text += event[1]
            ready = len(text) - held_back(text)
            if ready > sent or event[2]:
                piece, sent = text[sent:ready], max(sent, ready)
                yield _sse(chunk_body(job, id, created, text=piece, logprobs=event[2], token_bytes=token_bytes))
        elif event[0] == "text":
            yield _sse(chunk_body(job, id, created, text=event[1], logprobs=event[2], token_bytes=token_bytes))
        elif event[0] == "done":
            _, result, finish = event
            if calling:
                content, calls = tool_calls(job, text[sent:])
                if content and calls:
                    yield _sse(chunk_body(job, id, created, text=content))
                elif not calls and text[sent:]:
                    yield _sse(chunk_body(job, id, created, text=text[sent:]))
                for chunk in tool_call_chunks(job, id, created, calls):
                    yield _sse(chunk)
                if calls and finish in ("eog", "stop"):
                    finish = "tool_calls"
            last = chunk_body(job, id, created, finish=finish, tokens=result.tokens if job.return_tokens else None)
            # llama-server's habit: the last chunk carries usage; and ours, the speculation
            last["usage"] = usage_body(result.stats)
            last["speculative"] = speculative_body(result.stats, handle.policy)
            yield _sse(last)
            if job.include_usage:  # OpenAI's: a last chunk with no choices, only usage
                yield _sse(
                    {
                        "id": id,
                        "object": last["object"],
                        "created": created,
                        "model": job.model,
                        "system_fingerprint": fingerprint(job.model),
                        "choices": [],
                        "usage": last["usage"],
                        "speculative": last["speculative"],
                    }
                )
            break
        else:  # an error after the headers went out: vLLM's way
            yield _sse(event[1].body())
            break
    yield "data: [DONE]\n\n"


# -- running it -------------------------------------------------------------------------------------


def serve(
    service: Service,
    host: str = "127.0.0.1",
    port: int = 8000,
    sockets=None,
    log_level: str = "info",
    on_ready=None,
    on_listening=None,
) -> int:
    """Run the HTTP server until a signal drains it (or, in a thread, until `.should_exit`). The
    process's exit code: 0 when it drained, 128 + the signal's number when a second signal cut it
    short (130 for a second Ctrl-C). `on_ready(server)` runs before it starts; `on_listening(port)`
    once it listens, with the port it bound (port 0 picks a free one)."""
    import uvicorn

    app = create_app(service)
    # connections at once: past it uvicorn answers 503 at once, so that clients that hold sockets
    # open (sending a byte at a time) cannot take every file descriptor
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        limit_concurrency=max(MAX_CONNECTIONS, 4 * service.capacity),
        http=_header_timeout_protocol(service),
    )
    server = DrainingServer(config, service, on_listening)
    if on_ready is not None:
        on_ready(server)
    try:
        server.run(sockets=sockets)
    finally:
        service.close()
    return 128 + server.forced_by if server.forced_by else 0


def _header_timeout_protocol(service: Service):
    """uvicorn's HTTP/1.1 protocol (h11) with a time limit on a request's headers: uvicorn closes
    a keep-alive connection left idle and the app times out a body (BODY_TIMEOUT), but nothing
    timed out headers, so a client sending them a byte at a time held its socket for good. The
    clock starts when the connection opens and again when a response ends, and stops when a
    request's headers are complete. Past `service.header_timeout` the connection is closed, with
    a 408 if the client had sent part of a request (nothing was answered on it yet). Always h11,
    even where httptools is installed, so that the limit holds whatever the environment."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _HeaderTimeoutProtocol(H11Protocol):
        header_clock: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_clock()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._awaiting_headers():
                self._stop_clock()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request already received
            if not self.transport.is_closing() and self._awaiting_headers():
                self._start_clock()

        def connection_lost(self, exc) -> None:
            self._stop_clock()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            """No request under way: h11 leaves the client's state IDLE until its headers end."""
            return self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE

        def _start_clock(self) -> None:
            self._stop_clock()
            self.header_clock = self.loop.call_later(service.header_timeout, self._out_of_time)

        def _stop_clock(self) -> None:
            if self.header_clock is not None:
                self.header_clock.cancel()
                self.header_clock = None

        def _out_of_time(self) -> None:
            self.header_clock = None
            if self.transport.is_closing() or not self._awaiting_headers():
                return
            if self.conn.trailing_data[0]:  # part of a request came: it gets an answer
                error = RequestError(
                    f"the request headers took more than {service.header_timeout:g} s to arrive",
                    code="timeout",
                    status=408,
                )
                service.metrics.rejected(408)
                body = json.dumps(error.body()).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ]
                for event in (
                    h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                    h11.Data(data=body),
                    h11.EndOfMessage(),
                ):
                    self.transport.write(self.conn.send(event))
            self.transport.close()

    return _HeaderTimeoutProtocol


def _draining_server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """uvicorn, but the first SIGTERM / SIGINT drains instead of closing the listener: new
        requests get 503 while the ones in flight finish; then it exits (code 0). A second
        signal exits at once."""

        def __init__(self, config, service: Service, on_listening=None):
            super().__init__(config)
            self.service, self.on_listening = service, on_listening
            self.forced_by = 0  # the signal that cut the drain short
            self.cut_at = 0.0  # when the requests it cut were told so

        def handle_exit(self, sig, frame) -> None:
            if self.forced_by:  # a third signal: no more waiting for anything
                self.should_exit = self.force_exit = True
                return
            if self.service.draining or sig not in (signal.SIGTERM, signal.SIGINT):
                # a second signal: every request still running ends with an error event (a 503
                # if nothing was sent yet), and the process exits as soon as they are told, at
                # most CUT_GRACE seconds from now
                self.forced_by = int(sig)
                self.cut_at = time.monotonic()
                self.service.draining = True
                self.service.worker.abort()
                return
            log.warning("draining: %d request(s) in flight; new requests get 503", self.service.inflight)
            self.service.draining = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.on_listening is not None and self.started:
                bound = [s.getsockname() for server in self.servers for s in server.sockets]
                self.on_listening(bound[0][1] if bound else self.config.port)

        async def on_tick(self, counter: int) -> bool:
            if self.service.draining and self.service.idle:
                self.should_exit = True
            if self.forced_by and (self.service.idle or time.monotonic() - self.cut_at > CUT_GRACE):
                self.should_exit = self.force_exit = True
            return await super().on_tick(counter)

    return _DrainingServer


def DrainingServer(config, service: Service, on_listening=None):
    return _draining_server_class()(config, service, on_listening)
