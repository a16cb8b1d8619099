#!/usr/bin/env python3
"""An early-exit head on the torch backend drafting two ways, the same drafts: as a draft model of
its own (the target's first L layers and the B blocks with a KV cache of their own, so it reads the
prompt through L + B layers itself) against through the target's own cache (make_drafter's way since
2026-11-29: only the blocks' cache is theirs, kept by every target forward). The head is untrained:
its blocks are the target's own layers L .. L + B - 1 (what `specdec train early-exit:L+B` starts
from), so both ways draft exactly what the target's first L + B layers say. Interleaved, repeated;
prints each run and the medians, and checks that both wrote the same tokens.

    python benchmarks/exit_cache.py --target qwen2.5-coder-0.5b --layers 20 --blocks 2 --repeats 3

The prompt is a long one (the README's first 6 000 characters and a question), where the draft
model's own read of it shows; `--prompt TEXT -n 128` times the steps instead.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b", help="a built-in model name or a GGUF path")
    parser.add_argument("--layers", type=int, default=20, help="L: the target's layers before the blocks")
    parser.add_argument("--blocks", type=int, default=2, help="B: the head's blocks")
    parser.add_argument("-k", type=int, default=3, help="draft tokens a step")
    parser.add_argument("-n", type=int, default=32, help="tokens to write")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt", default=None, help="instead of the long one")
    args = parser.parse_args()

    import numpy as np

    from specdec import GenerationConfig, SpeculativeDecoder
    from specdec.catalog import resolve
    from specdec.drafters import headfile, model_drafter
    from specdec.drafters.early_exit import exit_head_drafter, exit_model_path
    from specdec.models.load import load_like
    from specdec.models.numpy_ref import load_numpy_model
    from specdec.models.transformers import load_transformers_model
    from specdec.train.exit import ExitHead

    gguf = resolve(args.target)
    reference = load_numpy_model(gguf, n_ctx=4096)  # (the head file's blocks are read from it)
    head = ExitHead(reference, args.layers, args.blocks, np.arange(reference.vocab_size))
    info = headfile.HeadInfo(
        kind="early-exit", target_sha256=reference.identity, target_name=reference.name, n_embd=reference.n_embd,
        vocab_size=reference.vocab_size, steps=args.k, layers=args.layers, blocks=args.blocks,
    )  # fmt: skip
    path = Path(tempfile.mkdtemp()) / f"exit-{args.layers}-{args.blocks}.head"
    headfile.save(str(path), info, head.file_tensors())
    del reference, head

    def target():
        return load_transformers_model(gguf, device=args.device, dtype=args.dtype, n_ctx=4096)

    targets = {"own cache": target(), "shared": target()}
    own = targets["own cache"]
    drafters = {
        "own cache": model_drafter(load_like(own, exit_model_path(own, path)), own, None, 1, 0),
        "shared": exit_head_drafter(targets["shared"], path),
    }
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:6000]
    prompt = args.prompt or f"Read this and answer in one sentence: what backends does it name?\n\n{readme}"
    config = GenerationConfig(max_new_tokens=args.n, chat=True)
    runs: dict[str, list] = {name: [] for name in targets}
    for r in range(args.repeats):
        for name in list(targets) if r % 2 == 0 else list(targets)[::-1]:
            decoder = SpeculativeDecoder(targets[name], drafter=drafters[name], k=args.k)
            t = time.perf_counter()
            out = decoder.generate(prompt, config)
            wall = time.perf_counter() - t
            s = out.stats
            runs[name].append((wall, s.prefill_seconds, s.draft_seconds, out.tokens))
            print(
                f"{name:9s} run {r}: wall {wall:6.2f} s, prefill {s.prefill_seconds:5.2f} s, drafting "
                f"{s.draft_seconds:5.2f} s, wrote {len(out.tokens)}, drafted {s.drafted}, kept {s.accepted}, prompt "
                f"{len(decoder.prompt_tokens(prompt, config))} tokens",
                flush=True,
            )
    same = all(run[3] == runs["own cache"][0][3] for rows in runs.values() for run in rows)
    for name, rows in runs.items():
        print(
            f"{name:9s} median wall {statistics.median(r[0] for r in rows):.2f} s, prefill "
            f"{statistics.median(r[1] for r in rows):.2f} s, drafting {statistics.median(r[2] for r in rows):.2f} s"
        )
    print(f"same tokens every run: {same}; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
