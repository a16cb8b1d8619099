"""Load generator for any OpenAI-compatible server (specdec serve, llama-server, vLLM, ...).

For each concurrency C, C clients stream chat completions over the same prompts of the suite
(each client takes the next prompt until none are left) and the run reports aggregate tokens/s
(completion tokens of all requests over the wall time of the run), time to first token, the gaps
between streamed chunks (ITL; one chunk may carry several tokens when a server speculates) and
time per output token (TPOT: a request's decode time over its tokens after the first), p50 / p99.
Every server is measured the same way: the numbers come from the client side only, except the
share of drafted tokens kept, which the server reports in its last chunk (specdec serve's
"speculative", llama-server's "timings"; "acceptance of N": N tokens drafted over the run).

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 -c 1 2 4 8 -n 8 --max-tokens 128
    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --label llama-server ...   # the same for a peer

Standard library only, so it runs anywhere a server does.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

SUITE = Path(__file__).resolve().parent / "prompts.jsonl"


def load_prompts(path: Path, n: int, categories: list[str] | None) -> list[str]:
    """n prompts, taking the categories in turn (so a short run still covers them all). A file that
    cannot be read, a line that is not a JSON object with "prompt" and "category", or no prompt
    left to send: ValueError, one line."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the suite {path}: {exc}") from None
    by_cat: dict[str, list[str]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            category, prompt = row["category"], row["prompt"]
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"{path}:{number}: not a JSON object with a prompt and a category") from None
        if categories is None or category in categories:
            by_cat.setdefault(category, []).append(prompt)
    if n < 1:
        raise ValueError(f"-n must be at least 1, got {n}")
    if not by_cat:
        wanted = f" of categories {', '.join(categories)}" if categories else ""
        raise ValueError(f"no prompt to send: {path} has none{wanted}")
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)]
        i += 1
    return out[:n]


def one_request(url, prompt: str, args) -> dict:
    """Stream one chat completion; client-side timings and the tokens the server reports."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.model:
        body["model"] = args.model
    if args.speculative:
        body["speculative"] = json.loads(args.speculative)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    conn = (http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection)(
        url.hostname, url.port, timeout=args.timeout
    )
    start = time.perf_counter()
    chunks: list[float] = []  # arrival times of chunks that carried text
    usage, n_chunks_text, spec = None, 0, None
    try:
        conn.request("POST", url.path.rstrip("/") + "/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                return {"error": str(obj["error"])[:300]}
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("speculative"):
                spec = obj["speculative"]
            elif (obj.get("timings") or {}).get("draft_n"):  # llama-server's: its drafts and kept ones
                spec = {"drafted": obj["timings"]["draft_n"], "accepted": obj["timings"].get("draft_n_accepted", 0)}
            for choice in obj.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks.append(time.perf_counter())
                    n_chunks_text += 1
    finally:
        conn.close()
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else n_chunks_text
    return {
        "start": start,
        "end": end,
        "tokens": tokens,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "ttft": chunks[0] - start if chunks else None,
        "itl": [b - a for a, b in zip(chunks, chunks[1:])],
        "tpot": (chunks[-1] - chunks[0]) / (tokens - 1) if len(chunks) > 1 and tokens > 1 else None,
        "speculative": spec,
    }


def run_level(url, prompts: list[str], concurrency: int, args) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    todo = list(enumerate(prompts))

    def client():
        while True:
            with lock:
                if not todo:
                    return
                _, prompt = todo.pop(0)
            r = one_request(url, prompt, args)
            with lock:
                results.append(r)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [g for r in ok for g in r["itl"]]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    spec = [r["speculative"] for r in ok if r["speculative"]]
    drafted, accepted = sum(s["drafted"] for s in spec), sum(s["accepted"] for s in spec)
    return {
        "label": args.label,
        "concurrency": concurrency,
        "requests": len(ok),
        "errors": errors,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "tpot_p50": pct(tpot, 50),
        "tpot_p99": pct(tpot, 99),
        "acceptance": accepted / drafted if drafted else None,
        "drafted": drafted,  # tokens drafted over the run (0: none, or a server that does not say)
    }


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


def fmt(row: dict) -> str:
    ms = lambda v: "-" if v is None else f"{1000 * v:.0f}"  # noqa: E731
    acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%} of {row['drafted']}"
    return (
        f"| {row['label']} | {row['concurrency']} | {row['tokens_per_s']:.1f} | {ms(row['ttft_p50'])} / "
        f"{ms(row['ttft_p99'])} | {ms(row['itl_p50'])} / {ms(row['itl_p99'])} | {ms(row['tpot_p50'])} / "
        f"{ms(row['tpot_p99'])} | {row['tokens']} | {acc} |"
        + (f" {len(row['errors'])} errors" if row["errors"] else "")
    )


HEADER = (
    "| server | C | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 / p99 ms | tokens "
    "| acceptance of drafted |\n"
    "|---|---|---|---|---|---|---|---|"
)


def main_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL (.../v1)")
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("-n", "--prompts", type=int, default=8, help="prompts per concurrency level (default 8)")
    p.add_argument("--suite", type=Path, default=SUITE)
    p.add_argument("--categories", nargs="+", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None, help="the model field to send (default: none)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--speculative", default=None, help='specdec only: e.g. \'{"draft": "none"}\'')
    p.add_argument("--repeats", type=int, default=1, help="runs per concurrency level (each is reported)")
    p.add_argument("--warmup", type=int, default=1, help="requests before measuring (default 1)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--label", default="server")
    p.add_argument("--json", type=Path, default=None, help="append one JSON line per run here")
    return p.parse_args(argv)


def base_url(args):
    return urlparse(args.url if args.url.rstrip("/").endswith("/v1") else args.url.rstrip("/") + "/v1")


def main(argv=None) -> int:
    args = main_args(argv)
    url = base_url(args)
    try:
        prompts = load_prompts(args.suite, args.prompts, args.categories)
    except ValueError as exc:  # one line, exit 2, before any request
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for _ in range(args.warmup):
        r = one_request(url, prompts[0], argparse.Namespace(**{**vars(args), "max_tokens": 8}))
        if "error" in r:
            print(f"warm-up failed: {r['error']}", file=sys.stderr)
            return 1
    print(HEADER, flush=True)
    for c in args.concurrency:
        for _ in range(args.repeats):
            row = run_level(url, prompts, c, args)
            print(fmt(row), flush=True)
            for e in row["errors"][:3]:
                print(f"  error: {e}", file=sys.stderr)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
