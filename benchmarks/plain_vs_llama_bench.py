#!/usr/bin/env python3
"""Plain decoding through specdec's llama.cpp backend next to llama-bench's tg128.

Same GGUF, same threads, same llama.cpp sources and CPU flags (scripts/build_llama_cpp_tools.py).
llama-bench decodes 128 tokens one at a time from an empty context; we decode 128 tokens with the
engine's plain path (k = 0) after a 1-token prompt, through exactly the code `specdec generate
--draft none` runs. Both report the median of --repeats runs.

    python benchmarks/plain_vs_llama_bench.py [--models NAME ...] [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama_bench(bin_dir: Path, model: Path, threads: int, repeats: int, n_gen: int) -> float:
    out = subprocess.run(
        [
            str(bin_dir / "llama-bench"),
            "-m",
            str(model),
            "-p",
            "0",
            "-n",
            str(n_gen),
            "-t",
            str(threads),
            "-r",
            str(repeats),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(json.loads(out)[0]["avg_ts"])


def specdec_plain(name: str, threads: int, repeats: int, n_gen: int) -> float:
    from specdec import SpeculativeDecoder, load_model

    model = load_model(name, threads=threads, progress=False)
    decoder = SpeculativeDecoder(model, None)
    bos = model.tokenizer.encode("", add_special=True) or model.tokenizer.encode("def", add_special=False)
    eog = model.tokenizer.eog_ids
    # Never stop early: strip end-of-generation tokens so every run decodes exactly n_gen tokens.
    model.tokenizer.eog_ids = frozenset()
    decoder.generate(bos, max_new_tokens=8)  # warm-up, as llama-bench does
    speeds = [decoder.generate(bos, max_new_tokens=n_gen).stats.tokens_per_second for _ in range(repeats)]
    model.tokenizer.eog_ids = eog
    return statistics.median(speeds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n-gen", type=int, default=128)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_llama_cpp_tools import main as build  # noqa: F401  (documented entry point)

    from specdec.catalog import resolve
    from specdec.models.llama_cpp import default_threads

    threads = args.threads or default_threads()
    bin_dir = Path(
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "build_llama_cpp_tools.py")],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    print(f"| model | threads | llama-bench tg{args.n_gen} tok/s | specdec plain tok/s | ratio |")
    print("|---|---|---|---|---|")
    for name in args.models:
        ref = llama_bench(bin_dir, resolve(name, progress=False), threads, args.repeats, args.n_gen)
        ours = specdec_plain(name, threads, args.repeats, args.n_gen)
        print(f"| {name} | {threads} | {ref:.2f} | {ours:.2f} | {ours / ref:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
