#!/usr/bin/env python3
"""Install llama-cpp-python built for *this* CPU, once, and reuse the wheel afterwards.

Why not plain `pip install llama-cpp-python`: its default build uses GGML_NATIVE, which on
Sapphire Rapids turns on the AMX kernels, and those segfault inside ggml_backend_amx_mul_mat.
We build with GGML_NATIVE=OFF and switch on exactly the x86 extensions /proc/cpuinfo reports
(never AMX), so the same script gives a working build on any x86-64 CPU.

pip caches built wheels without regard to CMAKE_ARGS, so we never let pip's cache answer: the
wheel is built with --no-cache-dir into $SPECDEC_HOME/wheels/<version>-<hash of the flags>/ and
installed from there; a second run (or CI on the same machine) skips the five-minute compile.

    python scripts/install_llama_cpp.py                     # build once, install into this Python
    python scripts/install_llama_cpp.py --print-cmake-args  # just print the flags for this CPU
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

VERSION = os.environ.get("SPECDEC_LLAMA_CPP_VERSION", "0.3.36")

# cpuinfo flag(s) -> ggml CMake option. Every flag of a row must be present.
X86_FEATURES = [
    (("avx",), "GGML_AVX"),
    (("avx2",), "GGML_AVX2"),
    (("fma",), "GGML_FMA"),
    (("f16c",), "GGML_F16C"),
    (("bmi2",), "GGML_BMI2"),
    (("avx_vnni",), "GGML_AVX_VNNI"),
    # ggml's GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: all five must be there.
    (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), "GGML_AVX512"),
    (("avx512_vnni",), "GGML_AVX512_VNNI"),
    (("avx512_bf16",), "GGML_AVX512_BF16"),
    (("avx512vbmi",), "GGML_AVX512_VBMI"),
]


def specdec_home() -> Path:
    """Same rule as specdec.catalog.specdec_home (kept standalone: this runs before install)."""
    if os.environ.get("SPECDEC_HOME"):
        return Path(os.environ["SPECDEC_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "specdec"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args() -> str:
    """CMAKE_ARGS for this machine; a user-set CMAKE_ARGS wins (e.g. -DGGML_CUDA=ON)."""
    if os.environ.get("CMAKE_ARGS"):
        return os.environ["CMAKE_ARGS"]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ""  # ARM & co.: the native build has no AMX problem
    flags = cpu_flags()
    args = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    for needed, option in X86_FEATURES:
        args.append(f"-D{option}={'ON' if all(f in flags for f in needed) else 'OFF'}")
    return " ".join(args)


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def main() -> int:
    args = cmake_args()
    if "--print-cmake-args" in sys.argv[1:]:
        print(args)
        return 0
    tag = hashlib.sha256(f"{VERSION} {args} {sys.version_info[:2]}".encode()).hexdigest()[:12]
    wheel_dir = specdec_home() / "wheels" / f"llama-cpp-python-{VERSION}-{tag}"
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        print(f"building llama-cpp-python {VERSION} for this CPU (about 5 minutes, once)")
        print(f"CMAKE_ARGS={args}", flush=True)
        env = dict(os.environ, CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        tmp = wheel_dir.with_name(wheel_dir.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-cache-dir",
                "--no-deps",
                "-w",
                str(tmp),
                f"llama-cpp-python=={VERSION}",
            ],
            env=env,
        )
        tmp.rename(wheel_dir)
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    else:
        print(f"reusing {wheels[-1]}")
    run([sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(wheels[-1])])
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "typing-extensions>=4.5",
            "diskcache>=5.6.1",
            "jinja2>=2.11.3",
            "numpy>=1.20",
        ]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
