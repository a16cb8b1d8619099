#!/usr/bin/env python3
"""The GPU path, measured on random-weight models of real shapes (benchmarks/configs/*.json).

    python benchmarks/gpu_bench.py --out DIR [--parts costs engine hf] [--targets 1.5b 7b]

- costs:  `specdec costs --random-weights` for every config, batch 1 and 4, depths 128 and 1024,
          bfloat16, with the dynamic cache and with the static cache + CUDA graphs -> DIR/costs-*.json
- engine: the whole engine (SpeculativeDecoder) over 4 prompts of 128 random tokens, generating
          --tokens each, batch 1 (one after another) and batch 4: plain decoding and a synthetic
          drafter of known acceptance a (specdec_lab/synthetic.py), per cache layout. Per decode step:
          the wall time, the target's forward_rows, the model call inside it (synchronised), the
          rest (Python: controller, verification, rollback, emit) -> DIR/engine.json
- hf:     Hugging Face generate() plain, assisted (the 0.5B random-weight model drafting) and prompt
          lookup on the same model and prompts, against ours: plain, draft:4 with the same 0.5B,
          ngram:8 (static cache + graphs) -> DIR/hf.json

Random weights give the right shapes, so the right costs, but not the right text: a random
draft model agrees with a random target about 0% of the time, which is why the engine is timed
with the synthetic drafter, and assisted decoding here shows its cost, not its benefit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

SHAPES = ("0.5b", "1.5b", "7b")
CONFIGS = {name: ROOT / "benchmarks" / "configs" / f"qwen2.5-coder-{name}.json" for name in SHAPES}
LAYOUTS = (("dynamic", False, False), ("static", False, False), ("static", True, False), ("static", True, True))
# What every layer writes to the residual stream (o_proj, down_proj) is scaled by this. With the
# configs' own initialisation a random model's logits are near ties everywhere, so bfloat16
# rounding that differs between batch shapes (1 token vs k + 1, 1 row vs 4) changes its greedy
# output within a few tokens (seen on the H100: the 4-row run and every drafted run parted from the
# 1-row plain output, and a drafter proposing that output was accepted 2% of the time). Damped,
# the embedding dominates the residual stream and the greedy choice has a clear margin; the
# matrices are as large as before, so the costs are the same.
DAMP = 0.01


def log(*args) -> None:
    print(*args, flush=True)


def sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# -- costs --------------------------------------------------------------------------------------


def part_costs(args, out: Path) -> None:
    from specdec.cli import main

    for name in args.configs:
        for cache, graphs in (("dynamic", False), ("static", True)) if args.device == "cuda" else (("dynamic", False),):
            tag = f"{name}-{cache}{'-graphs' if graphs else ''}"
            argv = [
                "costs",
                "--backend",
                "torch",
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--random-weights",
                str(CONFIGS[name]),
                "--rows",
                "1",
                "4",
                "--depths",
                *map(str, args.depths),
                "--repeats",
                str(args.repeats),
                "--ctx",
                "2048",
                "--cache",
                cache,
                "--out",
                str(out / f"costs-{tag}.json"),
            ] + (["--graphs"] if graphs else [])
            t = time.perf_counter()
            code = main(argv)
            log(f"costs {tag}: exit {code} in {time.perf_counter() - t:.1f} s")
            _free()


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the engine, instrumented -------------------------------------------------------------------


class Probe:
    """Times the engine's steps, the target's forward_rows (verification vs prefill) and the
    model call inside (eager forward or graph replay, synchronised so the GPU work is in it)."""

    def __init__(self, target):
        self.target = target
        self.reset()
        self._verify = False
        self._in_replay = False  # a graph's capture runs the eager forward inside _replay
        forward_rows, model_forward, replay = target.forward_rows, target.model.forward, target._replay

        def timed_forward_rows(tokens, n_logits=None):
            self._verify = bool(n_logits)
            t = time.perf_counter()
            try:
                return forward_rows(tokens, n_logits)
            finally:
                seconds = time.perf_counter() - t
                key = "verify" if self._verify else "prefill"
                self.seconds[key] += seconds
                self.calls[key] += 1
                self._verify = False

        def timed(fn, eager: bool = False):
            def wrapper(*a, **kw):
                import torch

                # a graph's capture runs the eager forward: no synchronising there, and the
                # replay that follows is what counts
                if eager and (
                    self._in_replay or (target.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
                ):
                    return fn(*a, **kw)
                self._in_replay = not eager
                graphs = len(target._graph_cache)
                sync(target.device)
                t = time.perf_counter()
                try:
                    result = fn(*a, **kw)
                finally:
                    self._in_replay = False
                sync(target.device)
                if len(target._graph_cache) > graphs:  # a capture: counted apart
                    if self._verify:
                        self.seconds["capture"] += time.perf_counter() - t
                elif self._verify:
                    self.seconds["model"] += time.perf_counter() - t
                return result

            return wrapper

        target.forward_rows = timed_forward_rows
        if not target.compiled:  # a compiled forward would trace the timer: its replays are timed
            target.model.forward = timed(model_forward, eager=True)
        target._replay = timed(replay)
        self._model_forward = model_forward

    def close(self) -> None:
        """Give the shared model its own forward back."""
        self.target.model.forward = self._model_forward

    def reset(self) -> None:
        self.seconds = {"verify": 0.0, "prefill": 0.0, "model": 0.0, "capture": 0.0}
        self.calls = {"verify": 0, "prefill": 0}


def run_engine(target, drafter, k: int, prompts: list[list[int]], tokens: int, batch: int, probe: Probe) -> dict:
    from specdec import GenerationConfig, SpeculativeDecoder

    config = GenerationConfig(max_new_tokens=tokens, temperature=0.0, chat=False)
    decoder = SpeculativeDecoder(target, drafter, k if drafter is not None else 0)
    probe.reset()
    sync(target.device)
    t = time.perf_counter()
    results = []
    for start in range(0, len(prompts), batch):
        results += decoder.generate_batch(prompts[start : start + batch], config)
    sync(target.device)
    wall = time.perf_counter() - t
    # decoding time: without the prefill, and without CUDA graph captures (once per shape)
    capture = probe.seconds["capture"]
    decode = wall - probe.seconds["prefill"] - capture
    probe.seconds["verify"] -= capture
    steps = probe.calls["verify"]
    generated = sum(r.stats.generated_tokens for r in results)
    draft = sum(r.stats.draft_seconds for r in results) / max(1, min(batch, len(prompts)))
    return {
        "tokens": generated,
        "wall_s": wall,
        "decode_s": decode,
        "capture_s": capture,
        "tokens_per_s": generated / decode,
        "steps": steps,
        "accepted": sum(r.stats.accepted for r in results),
        "drafted": sum(r.stats.drafted for r in results),
        "per_step_ms": {
            "wall": 1e3 * decode / steps,
            "forward_rows": 1e3 * probe.seconds["verify"] / steps,
            "model": 1e3 * probe.seconds["model"] / steps,
            "forward_rows_python": 1e3 * (probe.seconds["verify"] - probe.seconds["model"]) / steps,
            "engine_python": 1e3 * (decode - probe.seconds["verify"] - draft) / steps,
            "draft": 1e3 * draft / steps,
        },
        "outputs": [r.tokens for r in results],
    }


def load(name: str, args, cache: str = "dynamic", graphs: bool = False):
    import torch

    from specdec.models.transformers import ByteTokenizer, load_random_weights

    model = load_random_weights(
        CONFIGS[name], device=args.device, dtype=args.dtype, n_ctx=args.ctx, cache=cache, graphs=graphs
    )
    model.tokenizer = ByteTokenizer(model.vocab_size, None)  # random weights: never stop early
    with torch.no_grad():
        for weight_name, weight in model.model.named_parameters():
            if weight_name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.mul_(DAMP)
        head, embedding = model.model.get_output_embeddings().weight, model.model.get_input_embeddings().weight
        if head.data_ptr() != embedding.data_ptr():
            # an untied head (the 7B) is random against the embedding, so its greedy choice has
            # no margin either: give it the embedding's values (still its own matrix, same cost)
            head.copy_(embedding)
    return model


def rebuild(model, cache: str, graphs: bool, compile: bool = False):
    """The same weights behind another cache layout."""
    from specdec.models.transformers import TransformersModel

    return TransformersModel(
        model.model, model.tokenizer, model.name, model.n_ctx, False, cache=cache, graphs=graphs, compile=compile
    )


def prompts_for(vocab: int, n: int = 4, length: int = 128) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(256, vocab, length).tolist() for _ in range(n)]


def part_engine(args, out: Path) -> None:
    from specdec_lab.synthetic import SyntheticDrafter

    report = {}
    for name in args.targets:
        base = load(name, args)
        prompts = prompts_for(base.vocab_size)
        reference = None
        for cache, graphs, compile in LAYOUTS:
            layout = f"{cache}{'+graphs' if graphs else ''}{'+compile' if compile else ''}"
            if (graphs and args.device != "cuda") or layout not in args.layouts:
                continue
            target = rebuild(base, cache, graphs, compile)
            probe = Probe(target)
            run_engine(target, None, 0, prompts[:1], 8, 1, probe)  # warm-up (and graph captures)
            for batch in (1, 4):
                plain = run_engine(target, None, 0, prompts, args.tokens, batch, probe)
                if reference is None:
                    reference = plain["outputs"]
                runs = {"plain": plain}
                for a in args.acceptance:
                    continuations = {tuple(p): o for p, o in zip(prompts, reference)}
                    drafter = SyntheticDrafter(continuations, a, target.vocab_size, seed=1)
                    runs[f"synthetic a={a} k={args.k}"] = run_engine(
                        target, drafter, args.k, prompts, args.tokens, batch, probe
                    )
                for method, r in runs.items():
                    r["same_as_reference"] = sum(o == ref for o, ref in zip(r.pop("outputs"), reference)) / len(
                        reference
                    )
                    report[f"{name} | {layout} | batch {batch} | {method}"] = r
                    s = r["per_step_ms"]
                    log(
                        f"{name:5s} {layout:14s} b{batch} {method:22s} {r['tokens_per_s']:8.1f} tok/s  step "
                        f"{s['wall']:6.2f} ms = model {s['model']:6.2f} "
                        f"+ forward_rows py {s['forward_rows_python']:5.2f}"
                        f" + engine py {s['engine_python']:5.2f} + draft {s['draft']:5.2f}  "
                        f"acc {r['accepted']}/{r['drafted']}  same {r['same_as_reference']:.2f}"
                    )
            probe.close()
            del target, probe
            _free()
            (out / "engine.json").write_text(json.dumps(report, indent=1))
        del base
        _free()


# -- Hugging Face generate() against ours --------------------------------------------------------


def part_hf(args, out: Path) -> None:
    import torch

    from specdec import GenerationConfig, SpeculativeDecoder

    report = {}
    draft_base = load("0.5b", args)
    for name in args.targets:
        base = load(name, args)
        prompts = prompts_for(base.vocab_size)
        hf_model, hf_draft = base.model, draft_base.model
        if base.vocab_size != draft_base.vocab_size:
            log(
                f"{name}: the 0.5B's vocabulary ({draft_base.vocab_size}) is not the target's ({base.vocab_size}): "
                f"HF assisted decoding falls back to its universal-assisted path; ours needs the same vocabulary"
            )

        def hf(mode: str, k: int) -> dict:
            kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
            if mode == "assisted":
                kwargs.update(
                    assistant_model=hf_draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant"
                )
            elif mode == "prompt-lookup":
                kwargs.update(prompt_lookup_num_tokens=k)
            elif mode == "static":  # HF's fast path: a static cache, the forward compiled by generate()
                kwargs.update(cache_implementation="static")
            total, tokens, outputs = 0.0, 0, []
            for p in prompts:
                ids = torch.tensor([p], device=base.device)
                mask = torch.ones_like(ids)
                with torch.inference_mode():
                    sync(base.device)
                    t = time.perf_counter()
                    hf_model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **kwargs)
                    sync(base.device)
                    prefill = time.perf_counter() - t
                    t = time.perf_counter()
                    new = hf_model.generate(
                        ids, attention_mask=mask, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **kwargs
                    )[0, ids.shape[1] :]
                    sync(base.device)
                    total += time.perf_counter() - t - prefill
                tokens += int(new.shape[0])
                outputs.append(new.tolist())
            return {"tokens": tokens, "decode_s": total, "tokens_per_s": tokens / total, "outputs": outputs}

        runs = {}
        for mode, k in [
            m for m in (("plain", 0), ("prompt-lookup", 8), ("assisted", 4), ("static", 0)) if m[0] in args.hf_modes
        ]:
            try:
                hf(mode, k) if mode == "static" or not runs else None  # warm-up (static: the compile)
                runs[f"hf:{mode}" + (f":{k}" if k else "")] = hf(mode, k)
            except Exception as exc:  # a peer failing must not cost the rest of the lease
                log(f"hf {mode}: {type(exc).__name__}: {exc}")
        target = rebuild(base, "static", args.device == "cuda")
        draft = (
            rebuild(draft_base, "static", args.device == "cuda") if base.vocab_size == draft_base.vocab_size else None
        )
        config = GenerationConfig(max_new_tokens=args.tokens, temperature=0.0, chat=False)
        ours = {"plain": SpeculativeDecoder(target, None, 0), "ngram:8": SpeculativeDecoder(target, "ngram", 8)}
        if draft is not None:
            ours["draft:4"] = SpeculativeDecoder(target, draft, 4)
        for method, decoder in ours.items():
            decoder.generate(prompts[0], config, max_new_tokens=8)  # warm-up and captures
            results = [decoder.generate(p, config) for p in prompts]
            decode = sum(r.stats.decode_seconds for r in results)
            tokens = sum(r.stats.generated_tokens for r in results)
            runs[f"specdec:{method}"] = {
                "tokens": tokens,
                "decode_s": decode,
                "tokens_per_s": tokens / decode,
                "accepted": sum(r.stats.accepted for r in results),
                "drafted": sum(r.stats.drafted for r in results),
                "outputs": [r.tokens for r in results],
            }
        reference = runs.get("hf:plain", {}).get("outputs")
        for method, r in runs.items():
            outputs = r.pop("outputs")
            if reference:
                r["same_as_hf_plain"] = sum(o == ref for o, ref in zip(outputs, reference)) / len(reference)
            report[f"{name} | {method}"] = r
            log(
                f"{name:5s} {method:22s} {r['tokens_per_s']:8.1f} tok/s  ({r['tokens']} tokens, "
                f"{r['decode_s']:.2f} s)  same as hf:plain {r.get('same_as_hf_plain', '-')}"
                + (f"  acc {r['accepted']}/{r['drafted']}" if "drafted" in r else "")
            )
        del target, draft, base, hf_model
        _free()
        (out / "hf.json").write_text(json.dumps(report, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", nargs="+", default=["costs", "engine", "hf"], choices=("costs", "engine", "hf"))
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="shapes whose cost curves are measured",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        default=["1.5b", "7b"],
        choices=list(CONFIGS),
        help="targets the engine and the peers run",
    )
    parser.add_argument(
        "--config-dir",
        default=None,
        help="take qwen2.5-coder-*.json from here instead (tiny ones: a smoke test on the CPU)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--depths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step of the synthetic drafter")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.8], help="the synthetic drafter's a")
    parser.add_argument(
        "--hf-modes",
        nargs="+",
        default=["plain", "prompt-lookup", "assisted"],
        choices=["plain", "prompt-lookup", "assisted", "static"],
        help="generate() modes; static = cache_implementation='static' (compiled by generate)",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["dynamic", "static", "static+graphs"],
        choices=["dynamic", "static", "static+graphs", "static+graphs+compile"],
        help="cache layouts the engine runs with",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.config_dir:
        CONFIGS.update({name: Path(args.config_dir) / f"qwen2.5-coder-{name}.json" for name in SHAPES})
    import torch
    import transformers

    log(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        + (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
    )
    for part in args.parts:
        t = time.perf_counter()
        try:
            {"costs": part_costs, "engine": part_engine, "hf": part_hf}[part](args, out)
        except Exception:
            traceback.print_exc()
        log(f"== {part} took {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
