"""The one thread that owns the engine.

The engine is single-threaded: models, caches and drafters are touched by this thread only. The
HTTP side (asyncio) sends it commands through a thread-safe inbox -- add a request, cancel one,
stop -- and it answers each request through that request's asyncio queue (`call_soon_threadsafe`).
Its loop: take every waiting command (new requests join the engine's queue, cancelled ones leave
at once), end the requests past their time limit, run ONE engine step, then hand every request
the text it produced and report metrics. So a command waits at most one step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..config import GenerationConfig
from ..engine import Engine, Request
from ..request import finish_label
from ..spec import DraftSpec
from .metrics import Metrics
from .protocol import Job, RequestError

# An idle engine woken by a request waits until no other has come for this long before its first
# step (but no longer than GATHER_MAX in all, and not once the arrivals fill the free rows: one
# more could not join that step), so that clients arriving together start together:
# their prompts prefill in one forward, and none of them is already decoding while the others'
# prompts ride in its steps. So does an engine whose next step would only read prompts with a row
# to spare (its last decoding row just ended, and that row's client may be sending its next one).
# why: requests sent at once reach the engine a few milliseconds apart, one after another as the
# HTTP side reads them, and a first step (a whole prompt's prefill) takes seconds; a fixed window
# from the first arrival missed the last of 8; a prompt read alone the moment the last row ended
# kept two closed-loop clients from ever decoding together (history: docs/results/provenance.md#gather)
GATHER = 0.02
GATHER_MAX = 0.25

log = logging.getLogger("specdec.server")


@dataclass
class Handle:
    """One request, as both sides see it. The worker writes events to `events` (on the HTTP side's
    loop): ("admitted",), ("text", piece, logprobs), ("done", result, finish_reason), ("error", RequestError);
    logprobs: those of the tokens behind the piece (empty unless asked for)."""

    job: Job
    policy: DraftSpec
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    deadline: float  # time.monotonic() past which the request is ended
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)  # the prompt, prepared (Service.prepare)
    config: GenerationConfig | None = None  # the final config, its token budget settled
    request: Request | None = None  # the engine's, once added
    finish: str = ""  # a finish reason the worker imposed ("time_limit")
    closed: bool = False  # the worker is done with it
    # what metrics have seen of this request's stats
    seen_drafts: int = 0
    seen_drafted: int = 0
    seen_accepted: int = 0
    seen_drafted_at: list[int] = field(default_factory=list)
    seen_accepted_at: list[int] = field(default_factory=list)
    seen_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None

    def send(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the HTTP side's loop is gone (shutdown): nobody to tell
            pass


class Worker:
    def __init__(self, engine: Engine, router, metrics: Metrics):
        self.engine, self.router, self.metrics = engine, router, metrics
        self.target = engine.target
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: dict[int, Handle] = {}  # engine request id -> handle
        self.thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self.thread.start()

    # -- the HTTP side's verbs (any thread) --------------------------------------------------------

    def submit(self, handle: Handle) -> None:
        self.inbox.put(("add", handle))

    def cancel(self, handle: Handle) -> None:
        self.inbox.put(("cancel", handle))

    def abort(self) -> None:
        """End every request now with an error its client is told (a second signal cut the drain)."""
        self.inbox.put(("abort", None))

    def stop(self, timeout: float = 30.0) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    # -- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not (stopping and not self.engine.busy):
            commands = []
            if not stopping and not self.engine.busy:
                commands.append(self.inbox.get())  # idle: sleep until something arrives
                self._gather(commands, self._room())
            elif not stopping and self.engine.reads_prompts_only:
                self._gather(commands, self._room())  # the last decoding row just ended: its client may send again
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            try:
                for kind, handle in commands:
                    if kind == "stop":
                        stopping = True
                    elif kind == "add":
                        self._add(handle)
                    elif kind == "cancel":
                        self._cancel(handle, "")
                    elif kind == "abort":
                        self._end_all(
                            RequestError(
                                "the server was stopped before this request finished; retry on another replica",
                                code="shutting_down",
                                status=503,
                                type="unavailable_error",
                            )
                        )
                self._expire()
                if self.engine.busy:
                    self.engine.step()
                self._publish()
            except Exception as exc:  # a bug or a backend failure: never the server's end
                self._fail_all(exc)
        for handle in list(self.handles.values()):
            self._cancel(handle, "cancelled")
        self._publish()

    def _room(self) -> int:
        """Rows no request holds or waits for: how many arrivals the next step could read."""
        return self.engine.max_rows - len(self.engine.rows) - len(self.engine.queue)

    def _gather(self, commands: list, room: int | None = None) -> None:
        """More requests join `commands` while each comes within GATHER of the one before (GATHER_MAX
        in all) and fewer than `room` have come (None: no limit; one more could not join the step,
        so waiting for it only delays the rest: a server of one row never waits); a stop or an
        abort ends the wait, a cancel does not (every finished stream's handler sends one, a no-op,
        as its client closes: just before that client's next request)."""
        cap = time.monotonic() + GATHER_MAX
        deadline = min(cap, time.monotonic() + GATHER)

        def waiting() -> bool:
            if commands and commands[-1][0] not in ("add", "cancel"):
                return False
            return room is None or sum(kind == "add" for kind, _ in commands) < room

        while waiting() and (left := deadline - time.monotonic()) > 0:
            try:
                commands.append(self.inbox.get(timeout=left))
            except queue.Empty:
                break
            deadline = min(cap, time.monotonic() + GATHER)  # quiet for GATHER since the last one
        log.debug("gathered %d command(s) in %.1f ms", len(commands), 1000 * (time.monotonic() + GATHER_MAX - cap))

    def _add(self, handle: Handle) -> None:
        try:
            request = self.engine.add(handle.tokens, handle.config, handle.policy)
        except Exception as exc:
            log.error("adding a request failed:\n%s", traceback.format_exc())
            handle.closed = True
            handle.send(
                "error",
                RequestError(f"internal error while adding the request: {exc}", status=500, type="server_error"),
            )
            return
        handle.request = request
        self.handles[request.id] = handle
        handle.send("admitted")

    def _cancel(self, handle: Handle, finish: str) -> None:
        """End a request now (its row and caches are freed in the engine's cancel); `finish` is
        the reason its client is told, "" when the client is gone."""
        request = handle.request
        if handle.closed or request is None or request.done:
            return
        handle.finish = finish or "cancelled"
        self.engine.cancel(request)

    def _expire(self) -> None:
        now = time.monotonic()
        for handle in list(self.handles.values()):
            if now > handle.deadline and not handle.request.done:
                self._cancel(handle, "time_limit")

    def _fail_all(self, exc: Exception) -> None:
        """A step raised: every request in the engine is ended with an error (a 500 or an error
        event), their rows freed, and the server goes on."""
        log.error("engine step failed; ending the %d request(s) in it:\n%s", len(self.handles), traceback.format_exc())
        try:  # what the rows' caches hold is no longer certain: none is kept or copied out as its request ends
            self.engine.drop_idle()
        except Exception:
            log.error("dropping the kept rows failed:\n%s", traceback.format_exc())
        self._end_all(RequestError(f"internal error during generation: {exc}", status=500, type="server_error"))

    def _end_all(self, error: RequestError) -> None:
        """Every request in the engine ends with `error` (a response of its status, or an error
        event on a stream), its row freed."""
        for handle in list(self.handles.values()):
            try:
                self._cancel(handle, "cancelled")
            except Exception:
                log.error("cancelling after the failure failed too:\n%s", traceback.format_exc())
            handle.closed = True
            handle.send("error", error)
            self._forget(handle)

    def _forget(self, handle: Handle) -> None:
        if handle.request is not None:
            self.handles.pop(handle.request.id, None)

    def _publish(self) -> None:
        """Every request's new text to its client; metrics; finished requests leave."""
        now = time.monotonic()
        m = self.metrics
        # the gauges first: a client told it is done may read /metrics at once
        m.running.labels(m.model_name).set(len(self.engine.rows))
        m.waiting.labels(m.model_name).set(len(self.engine.queue))
        for handle in list(self.handles.values()):
            request = handle.request
            s = request.stats
            # speculation counters as they happen (they only grow), where a step since drafted (a
            # step that drafts nothing moves none of them: most steps at one row, none to copy)
            if s.drafted != handle.seen_drafted:
                drafts = s.drafted_at[0] if s.drafted_at else 0
                grow = len(s.drafted_at) - len(handle.seen_drafted_at)
                handle.seen_drafted_at += [0] * grow
                handle.seen_accepted_at += [0] * grow
                m.drafted(
                    drafts - handle.seen_drafts,
                    s.drafted - handle.seen_drafted,
                    s.accepted - handle.seen_accepted,
                    [d - e for d, e in zip(s.drafted_at, handle.seen_drafted_at)],
                    [a - e for a, e in zip(s.accepted_at, handle.seen_accepted_at)],
                )
                handle.seen_drafts, handle.seen_drafted, handle.seen_accepted = drafts, s.drafted, s.accepted
                handle.seen_drafted_at, handle.seen_accepted_at = list(s.drafted_at), list(s.accepted_at)
            if s.generated_tokens > handle.seen_tokens:
                if handle.first_token is None:
                    handle.first_token = now
                    m.ttft.labels(m.model_name).observe(now - handle.arrived)
                else:
                    m.itl.labels(m.model_name).observe(now - handle.last_token)
                handle.last_token = now
                handle.seen_tokens = s.generated_tokens
            piece, logprobs = request.read(), request.read_logprobs()
            if (piece or logprobs) and not handle.finish == "cancelled":
                handle.send("text", piece, logprobs)
            if request.done:
                finish = handle.finish or s.finish_reason
                n = s.generated_tokens
                tpot = (
                    (handle.last_token - handle.first_token) / (n - 1)
                    if n > 1 and handle.first_token is not None
                    else None
                )
                m.finished(
                    finish_label(finish),
                    s.prompt_tokens,
                    s.cached_tokens,
                    n,
                    now - handle.arrived,
                    tpot,
                )
                if handle.finish != "cancelled":
                    handle.send("done", request.result, finish)
                handle.closed = True
                self._forget(handle)
