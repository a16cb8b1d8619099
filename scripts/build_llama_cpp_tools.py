#!/usr/bin/env python3
"""Build llama.cpp's own tools (llama-bench, llama-speculative-simple, llama-completion, llama-server)
for benchmarks.

They are built from the llama.cpp sources vendored in the llama-cpp-python sdist of the version
we use, with the same CPU flags as our Python build (scripts/install_llama_cpp.py), into
$SPECDEC_HOME/llama.cpp-<version>-<flags hash>/bin. Nothing of llama.cpp is committed here.
Prints the bin folder on its last line.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from install_llama_cpp import VERSION, cmake_args, run, specdec_home  # noqa: E402

# llama-server: the peer of `specdec serve` (benchmarks/serve_load.py measures both the same way)
TOOLS = ["llama-bench", "llama-speculative-simple", "llama-completion", "llama-server"]


def main() -> int:
    args = cmake_args()
    tag = hashlib.sha256(f"{VERSION} {args}".encode()).hexdigest()[:12]
    home = specdec_home() / f"llama.cpp-{VERSION}-{tag}"
    bin_dir = home / "build" / "bin"
    if all((bin_dir / t).exists() for t in TOOLS):
        print(bin_dir)
        return 0
    src = home / "src"
    if not (src / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory() as tmp:
            run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    "-d",
                    tmp,
                    f"llama-cpp-python=={VERSION}",
                ]
            )
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            with tarfile.open(sdist) as tar:
                prefix = f"{sdist.name[: -len('.tar.gz')]}/vendor/llama.cpp/"
                members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
                for m in members:
                    m.name = m.name[len(prefix) :]
                tar.extractall(src, members=[m for m in members if m.name], filter="data")
    build = home / "build"
    run(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            # llama-server without its web UI: the UI would need npm or a download at build time,
            # and the API (all a benchmark talks to) does not depend on it
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            *args.split(),
        ]
    )
    # -j with a number: a bare -j lets make start every compile at once (llama-server's sources
    # take over a GB each to compile)
    run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TOOLS])
    print(bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
