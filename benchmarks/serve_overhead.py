"""Where one stream's time per token goes: the same greedy prompts decoded by llama-server (plain),
by `specdec serve` (plain; with --with-auto also `--draft auto`), by our engine in this process
(plain, no server) and by a bare loop of one-token forwards and argmax (the floor our llama.cpp
binding allows), the arms taking turns request by request, or with `-c C` wave by wave (C prompts
at once: C clients, or C rows of one batch). Prints each arm's TPOT (decode time over the tokens
after the first; a wave's median), its TTFT and its tokens per second over the wave's wall time
(what an aggregate tokens/s compares, paired wave by wave), each with its per-wave ratio to the
first arm, so a gap between servers is placed in the engine or in the serving layer (HTTP, the
event loop, the worker's publishing) or in reading the prompt; and, on Linux, the CPU time per
token of `specdec serve`'s event-loop thread, which shares the cores with llama.cpp's threads.

    python benchmarks/serve_overhead.py --llama-bin "$(python scripts/build_llama_cpp_tools.py | tail -n 1)" \
        --prompts 4 --rounds 3 --max-tokens 128 --threads 2
    python benchmarks/serve_overhead.py --llama-bin DIR -c 4 --prompts 8 --rounds 3 --max-tokens 128 --threads 2

Every round starts the servers afresh: on a VM one process can run its forwards ~30% slower
than the next one started with the same code and flags, for as long as it lives (measured on the
AVX-512 EPYC, 2026-12-05: one `specdec serve` at 44 ms a token for minutes while every server
started after it, and the same service in-process beside it, ran at 31-36), and a server kept
for every round would carry that into each ratio (the in-process arms live in this process for
all rounds). Without --llama-bin the first arm is `specdec serve`. Every server is loaded before
a round's first request and stays idle while another arm runs. Take the CPU to yourself while it
runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_compare  # noqa: E402
import serve_load  # noqa: E402


def main_thread_cpu(pid: int) -> float | None:
    """CPU seconds of a process's first thread (the server's event loop), or None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Turn(NamedTuple):
    """One arm's run of one wave."""

    tpot: float  # seconds a token after the first, the wave's median
    gap: float  # the median gap between tokens
    ttft: float  # the median time to the first token
    rate: float  # the wave's tokens over its wall time
    tokens: int


class Served:
    """An OpenAI-compatible server started by serve_compare.command; one streamed request = one run."""

    def __init__(self, server: str, args):
        self.server = server
        self.port = serve_compare.free_port()
        self.is_ours = server.startswith("specdec")
        self.proc = subprocess.Popen(
            serve_compare.command(server, args.concurrency, self.port, args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args

    def ready(self) -> None:
        serve_compare.wait_healthy(self.url, self.proc, 600)

    def run(self, wave: list[str]) -> Turn:
        """The wave's prompts sent at once, one client each: their median TPOT, the median gap
        between tokens over all of them (a stream held up by another's prefill weighs on the
        first, not the second), their median TTFT, the wave's tokens over its wall time (first
        request sent to last stream ended: what a client sees of the server's throughput)."""
        load = ["--url", self.url + "/v1", "-n", "1", "--max-tokens", str(self.args.max_tokens)]
        ns = serve_load.main_args(load + (["--model", self.args.target] if self.is_ours else []))
        url = serve_load.base_url(ns)
        results: list[dict] = [{}] * len(wave)

        def client(i: int) -> None:
            results[i] = serve_load.one_request(url, wave[i], ns)

        clients = [threading.Thread(target=client, args=(i,)) for i in range(len(wave))]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        for r in results:
            if "error" in r or not r.get("tpot"):
                raise SystemExit(f"{self.url}: {r.get('error', 'fewer than two tokens came back')}")
        gaps = [g for r in results for g in r["itl"]]
        tpot = statistics.median(r["tpot"] for r in results)
        tokens = sum(r["tokens"] for r in results)
        wall = max(r["end"] for r in results) - min(r["start"] for r in results)
        ttft = statistics.median(r["ttft"] for r in results)
        return Turn(tpot, statistics.median(gaps) if gaps else tpot, ttft, tokens / wall, tokens)

    def close(self) -> None:
        serve_compare.stop(self.proc)


class InProcess:
    """Our engine in this process (`loop=False`), or the bare forward-and-argmax loop (`loop=True`)."""

    def __init__(self, target, decoder, max_tokens: int, loop: bool):
        self.target, self.decoder, self.max_tokens, self.loop = target, decoder, max_tokens, loop

    def run(self, wave: list[str]) -> Turn:
        """The wave's prompts as rows of one batch: their median TPOT (twice: the rows start and
        step together, so it is also the gap between tokens), their median prefill (the TTFT
        without a server), their tokens over the call's wall time, their tokens."""
        import numpy as np

        start = time.perf_counter()
        if not self.loop:  # the chat template applied as for a request (the target is an instruct model)
            results = self.decoder.generate_batch(wave, max_new_tokens=self.max_tokens, temperature=0.0)
            wall = time.perf_counter() - start
            tpot = statistics.median(r.stats.decode_seconds / max(1, r.stats.generated_tokens - 1) for r in results)
            tokens = sum(r.stats.generated_tokens for r in results)
            prefill = statistics.median(r.stats.prefill_seconds for r in results)
            return Turn(tpot, tpot, prefill, tokens / wall, tokens)
        texts = [self.target.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in wave]
        rows = self.target.add_rows(len(wave))
        try:  # every prompt read in one forward, then one token a row a step, all rows to the end
            prompts = {row: self.target.tokenizer.encode(text) for row, text in zip(rows, texts)}
            logits = self.target.forward_rows(prompts, dict.fromkeys(rows, 1))
            tokens = {row: int(np.argmax(logits[row][-1])) for row in rows}
            first = time.perf_counter()
            for _ in range(self.max_tokens - 1):
                logits = self.target.forward_rows({row: [t] for row, t in tokens.items()}, dict.fromkeys(rows, 1))
                tokens = {row: int(np.argmax(logits[row][-1])) for row in rows}
            end = time.perf_counter()
            seconds, emitted = (end - first) / (self.max_tokens - 1), self.max_tokens * len(rows)
            return Turn(seconds, seconds, first - start, emitted / (end - start), emitted)
        finally:
            self.target.drop_rows(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--prompts", type=int, default=4, help="prompts of the suite, the categories in turn")
    p.add_argument("--rounds", type=int, default=3, help="every prompt through every arm, this many times")
    p.add_argument(
        "-c", "--concurrency", type=int, default=1, help="prompts decoded at once (clients, or rows in-process)"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--suite", type=Path, default=serve_load.SUITE)
    p.add_argument("--categories", nargs="+", default=None, help="only the suite's prompts of these categories")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model `specdec serve` holds (unused)")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--with-auto", action="store_true", help="also `specdec serve --draft auto`")
    p.add_argument("--llama-bin", default=None, help="llama.cpp's tools: llama-server is the first arm")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.concurrency < 1:
        p.error(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.max_tokens < 2:
        p.error(f"--max-tokens must be at least 2 (a time per token needs two), got {args.max_tokens}")
    try:  # before anything loads: a bad suite is a usage error, not a lost run
        prompts = serve_load.load_prompts(args.suite, args.prompts, args.categories)
    except ValueError as exc:
        p.error(str(exc))
    if args.llama_bin and not (Path(args.llama_bin) / "llama-server").is_file():
        p.error(f"no llama-server in {args.llama_bin}")

    from specdec import SpeculativeDecoder, load_model

    arms: dict[str, object] = {}
    try:
        if args.llama_bin:
            arms["llama-server"] = Served("llama:plain", args)
        arms["specdec serve"] = ours = Served("specdec:none", args)
        if args.with_auto:
            arms["specdec serve auto"] = Served("specdec:auto", args)
        # as `specdec serve --draft none --max-batch C` holds it: C rows, a cache stream each
        c = args.concurrency
        target = load_model(args.target, n_ctx=args.ctx, threads=args.threads, max_rows=c, trees=False)
        decoder = SpeculativeDecoder(target, None, max_rows=c)
        arms["engine in-process"] = InProcess(target, decoder, args.max_tokens, loop=False)
        arms["forward loop"] = InProcess(target, None, args.max_tokens, loop=True)
        names = list(arms)
        turns: dict[str, list[Turn]] = {name: [] for name in names}
        served_tokens, loop_cpu = 0, 0.0
        waves = [prompts[i : i + c] for i in range(0, len(prompts), c)]
        for round_ in range(args.rounds):
            if round_:  # every round on servers started afresh (the docstring says why)
                for name, arm in list(arms.items()):
                    if isinstance(arm, Served):
                        arm.close()
                        arms[name] = Served(arm.server, args)
                ours = arms["specdec serve"]
            for arm in arms.values():  # the round's servers, loading together, all up
                if isinstance(arm, Served):
                    arm.ready()
            for i, wave in enumerate(waves):
                # every other turn in the reverse order: no arm always runs first or after the same one
                for name in names if (round_ + i) % 2 == 0 else names[::-1]:
                    before = main_thread_cpu(ours.proc.pid) if arms[name] is ours else None
                    turn = arms[name].run(wave)
                    if before is not None:
                        served_tokens += turn.tokens
                        loop_cpu += main_thread_cpu(ours.proc.pid) - before
                    turns[name].append(turn)
                where = f"round {round_ + 1} {'wave' if c > 1 else 'prompt'} {i + 1}"
                last = {n: turns[n][-1] for n in names}
                shown = (f"{n} {t.tpot * 1e3:.2f} ms, {t.ttft:.2f} s, {t.rate:.2f} tok/s" for n, t in last.items())
                print(f"{where}: " + ", ".join(shown), flush=True)
    finally:
        for arm in arms.values():
            if isinstance(arm, Served):
                arm.close()
    first = names[0]
    measures = (
        ("TPOT, ms", "tpot", 1e3),
        ("gap between tokens (ITL p50), ms", "gap", 1e3),
        ("TTFT (in-process: the prefill), s", "ttft", 1.0),
        ("tokens/s of the wave, first request to last token", "rate", 1.0),
    )
    for label, field, scale in measures:
        print(f"\n| arm | {label}, median | over {first}: median of per-wave ratios | range |")
        print("|---|---|---|---|")
        for name in names:
            mine = [getattr(t, field) for t in turns[name]]
            ratios = [a / getattr(b, field) for a, b in zip(mine, turns[first])]
            print(
                f"| {name} | {statistics.median(mine) * scale:.2f} | {statistics.median(ratios):.3f} "
                f"| {min(ratios):.3f}-{max(ratios):.3f} |"
            )
    if served_tokens:
        print(f"\nspecdec serve's event-loop thread: {loop_cpu / served_tokens * 1e3:.3f} ms of CPU a token")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the servers were stopped on the way out (main's finally)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
