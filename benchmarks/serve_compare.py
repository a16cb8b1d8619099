"""`specdec serve` against llama-server, each started with C rows for C concurrent clients, measured
by benchmarks/serve_load.py the same way. Prints one markdown table (and appends JSON lines to --json).

    python benchmarks/serve_compare.py --llama-bin "$(python scripts/build_llama_cpp_tools.py | tail -n 1)" \
        --servers specdec:auto specdec:none llama:plain llama:ngram-simple llama:draft -c 1 2 4 8

Servers: specdec:<draft> (auto, none, ngram, or a draft model name), optionally with
",stall=X", ",waste=W", ",objective=latency", ",long=S" (its --prefill-stall, --prefill-waste,
--objective, --long-step-share),
llama:plain, llama:ngram-simple, llama:ngram-mod, llama:draft (the 0.5B draft model, 4 tokens),
and `vllm serve` (`make vllm-peer`) as vllm:plain, vllm:ngram:K,
vllm:draft:K, vllm:suffix:K, or with our proposers inside it, vllm:specdec:auto:K,
vllm:specdec:ngram:K, vllm:specdec:suffix:K (specdec.vllm_peer.speculative_config).
The prompts are our suite's (benchmarks/prompts.jsonl) unless --suite names another, such as
benchmarks/dev-prompts.jsonl, with --categories to take some of its categories only.
With --repeats R every cell runs R times, the servers taking turns within each round, in the
reverse order every other round (a drifting machine then moves every server alike), and a last
table gives each cell's median and its spread (max / min tokens/s over the repeats).
Take the CPU to yourself while it runs: timings on a shared CPU mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import serve_load  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not come up")


def command(server: str, c: int, port: int, args) -> list[str]:
    name, *options = server.split(",")
    kind, _, variant = name.partition(":")
    options = dict(o.split("=", 1) for o in options)
    if kind == "specdec":
        flags = {
            "stall": "--prefill-stall",
            "waste": "--prefill-waste",
            "objective": "--objective",
            "long": "--long-step-share",
        }
        unknown = set(options) - set(flags)
        if unknown:
            raise SystemExit(f"{server}: unknown option(s) {', '.join(sorted(unknown))} (known: {', '.join(flags)})")
        extra = [part for key, value in options.items() for part in (flags[key], value)]
        return [
            sys.executable,
            "-m",
            "specdec.cli",
            "serve",
            "--target",
            args.target,
            "--draft",
            variant or "auto",
            "--draft-model",
            args.draft,
            "--max-batch",
            str(c),
            "--ctx",
            str(args.ctx),
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ] + (["--threads", str(args.threads)] if args.threads else [])
    if kind == "vllm":  # `vllm serve` in the vLLM venv (`make vllm-peer`), on the converted folder
        from specdec.peers import check_vllm, vllm_folder, vllm_python
        from specdec.vllm_peer import speculative_config

        check_vllm(args.target, args.draft if variant.startswith("draft:") else None)
        spec = speculative_config(variant or "plain", str(vllm_folder(args.draft)))
        cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_folder(args.target))]
        cmd += ["--served-model-name", args.target, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--max-model-len", str(args.ctx), "--max-num-seqs", str(c), "--dtype", "bfloat16"]
        cmd += ["--generation-config", "vllm"]
        return cmd + (["--speculative-config", json.dumps(spec)] if spec else [])
    from specdec.catalog import resolve

    base = [
        str(Path(args.llama_bin) / "llama-server"),
        "-m",
        str(resolve(args.target)),
        "-c",
        str(args.ctx * c),
        "-np",
        str(c),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-webui",
        "-lv",
        "0",
    ]
    if args.threads:
        base += ["-t", str(args.threads)]
    # the same settings as `specdec bench`'s llama.cpp peer (src/specdec/peers.py)
    spec = {
        "plain": [],
        "ngram-simple": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"],
        "ngram-mod": ["--spec-type", "ngram-mod", "--spec-draft-n-max", "8"],
        "draft": ["--spec-type", "draft-simple", "-md", str(resolve(args.draft)), "--spec-draft-n-max", "4"],
    }[variant or "plain"]
    return base + spec


def run_cell(server: str, c: int, args) -> dict:
    """Start `server` for C rows, load it with C clients, stop it; the run's row."""
    port = free_port()
    env = None
    if server.startswith("vllm"):
        from specdec.vllm_peer import engine_env

        env = dict(os.environ, **engine_env(args.threads or os.cpu_count()))
        env["PYTHONPATH"] = str(HERE.parent / "src")  # this checkout's proposers
    proc = subprocess.Popen(
        command(server, c, port, args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE if server.startswith("specdec") else subprocess.DEVNULL,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 600)
        load = ["--url", url + "/v1", "-c", str(c), "-n", str(args.prompts), "--max-tokens", str(args.max_tokens)]
        load += ["--label", server, "--suite", str(args.suite)]
        if args.categories:
            load += ["--categories", *args.categories]
        if server.startswith(("specdec", "vllm")):
            load += ["--model", args.target]
        ns = serve_load.main_args(load)
        prompts = serve_load.load_prompts(ns.suite, ns.prompts, ns.categories)
        serve_load.one_request(serve_load.base_url(ns), prompts[0], argparse.Namespace(**{**vars(ns), "max_tokens": 8}))
        row = serve_load.run_level(serve_load.base_url(ns), prompts, c, ns)
        print(serve_load.fmt(row), flush=True)
        for e in row["errors"][:3]:
            print(f"  error: {e}", file=sys.stderr)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row
    finally:
        stop(proc)


def stop(proc) -> None:
    """Stop a server started here: SIGTERM, then SIGKILL if it has not exited within a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", nargs="+", default=["specdec:auto", "specdec:none", "llama:plain"])
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("-n", "--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--suite", type=Path, default=serve_load.SUITE, help="the prompts (default: our suite)")
    p.add_argument("--categories", nargs="+", default=None, help="only the suite's prompts of these categories")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--ctx", type=int, default=4096, help="per row")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--llama-bin", default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--repeats", type=int, default=1, help="rounds; the servers take turns within each")
    args = p.parse_args(argv)
    try:  # the prompts are read before any server starts: a bad suite is a usage error, not a lost run
        serve_load.load_prompts(args.suite, args.prompts, args.categories)
    except ValueError as exc:
        p.error(str(exc))
    print(serve_load.HEADER, flush=True)
    rows = []
    for round_ in range(args.repeats):
        for c in args.concurrency:
            # every other round in the reverse order, so no server always runs first (or right
            # after the same neighbour) in a cell
            for server in args.servers if round_ % 2 == 0 else args.servers[::-1]:
                rows.append(run_cell(server, c, args))
    if args.repeats > 1:
        print("\nmedian over the repeats (spread: max / min tokens/s)", flush=True)
        print(serve_load.HEADER, flush=True)
        for c in args.concurrency:
            for server in args.servers:
                cell = [r for r in rows if r["label"] == server and r["concurrency"] == c]
                tps = [r["tokens_per_s"] for r in cell]
                median = {
                    key: statistics.median(r[key] for r in cell)
                    for key, value in cell[0].items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool)
                }
                line = serve_load.fmt({**cell[0], **median})
                print(f"{line} spread {max(tps) / min(tps):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
