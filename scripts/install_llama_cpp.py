#!/usr/bin/env python3
"""Install llama-cpp-python built for *this* CPU, once, and reuse the wheel afterwards.

Why not plain `pip install llama-cpp-python`: its default build uses GGML_NATIVE, which on
Sapphire Rapids turns on the AMX kernels, and those segfault inside ggml_backend_amx_mul_mat.
We build with GGML_NATIVE=OFF and switch on exactly the x86 extensions /proc/cpuinfo reports
(never AMX), so the same script gives a working build on any x86-64 CPU.

pip caches built wheels without regard to CMAKE_ARGS, so we never let pip's cache answer: the
wheel is built with --no-cache-dir into $SPECDEC_HOME/wheels/<version>-<hash of the flags>/ and
installed from there; a second run (or CI on the same machine) skips the five-minute compile.

The exact mode (`specdec generate --exact`) needs a second build of the same version without
llamafile's sgemm (-DGGML_LLAMAFILE=OFF): for batches of 2 or more tokens that sgemm multiplies the
f16 attention matrices in another order than the one-token kernels, so a verification forward's
logits would differ from plain decoding's in the last bits. `--exact` builds it (cached the same way)
and unpacks only its shared libraries into $SPECDEC_HOME/llama-exact/<version>/lib/, which
models/llama_cpp.py loads through llama-cpp-python's LLAMA_CPP_LIB_PATH in an exact process.

    python scripts/install_llama_cpp.py                     # build once, install into this Python
    python scripts/install_llama_cpp.py --exact             # the exact mode's libraries, once
    python scripts/install_llama_cpp.py --print-cmake-args  # just print the flags for this CPU
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import zipfile
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


EXACT_ARGS = "-DGGML_LLAMAFILE=OFF"


def exact_lib_dir() -> Path:
    """Where the exact build's libraries go (models/llama_cpp.exact_lib_dir reads the same place)."""
    return specdec_home() / "llama-exact" / VERSION / "lib"


def unpack_libs(wheel: Path, dest: Path) -> None:
    """The wheel's llama_cpp/lib/ shared libraries into dest, whole or not at all."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("llama_cpp/lib/") and not name.endswith("/"):
                (tmp / Path(name).name).write_bytes(zf.read(name))
    if not (tmp / "libllama.so").is_file():
        raise SystemExit(f"{wheel} has no llama_cpp/lib/libllama.so")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def main() -> int:
    args = cmake_args()
    exact = "--exact" in sys.argv[1:]
    if exact:
        args = f"{args} {EXACT_ARGS}".strip()
    if "--print-cmake-args" in sys.argv[1:]:
        print(args)
        return 0
    if exact and (exact_lib_dir() / "libllama.so").is_file():
        print(f"the exact build is in {exact_lib_dir()}")
        return 0
    tag = hashlib.sha256(f"{VERSION} {args} {sys.version_info[:2]}".encode()).hexdigest()[:12]
    wheel_dir = specdec_home() / "wheels" / f"llama-cpp-python-{VERSION}-{tag}"
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        what = "the exact mode's build of llama-cpp-python" if exact else "llama-cpp-python"
        print(f"building {what} {VERSION} for this CPU (about 5 minutes, once)")
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
    if exact:
        unpack_libs(wheels[-1], exact_lib_dir())
        print(f"the exact build is in {exact_lib_dir()}")
        return 0
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
