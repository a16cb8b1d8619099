#!/usr/bin/env python3
"""Install llama-cpp-python built for *this* CPU, once, and reuse the wheel afterwards.

Why not plain `pip install llama-cpp-python`: its default build uses GGML_NATIVE, which on
Sapphire Rapids turns on the AMX kernels, and those segfault inside ggml_backend_amx_mul_mat.
We build with GGML_NATIVE=OFF and switch on exactly the x86 extensions /proc/cpuinfo reports
(never AMX), so the same script gives a working build on any x86-64 CPU.

pip caches built wheels without regard to CMAKE_ARGS, so we never let pip's cache answer: the
wheel is built with --no-cache-dir into $SPECDEC_HOME/wheels/<version>-<hash of the flags>/ and
installed from there; a second run (or CI on the same machine) skips the five-minute compile.

The exact mode (`specdec generate --exact`) needs a second build of the same version (docs/guide/exact.md):
- without llamafile's sgemm (-DGGML_LLAMAFILE=OFF): for batches of 2 or more tokens it multiplies
  the f16 attention matrices in another order than the one-token kernels;
- with ggml's Q4_K and Q6_K dot products ending each 256-value block the way its tiled matmul
  (ggml-cpu/tiled/) ends it: the block's exact integer sum, then the same three float operations
  in the same order (patch_exact below); the other types the tiled matmul handles go back to the
  dot products, and it takes 20 or more rows (8 by default), where it is the faster kernel.
  Integer sums do not depend on their order, so a one-token step and a forward of many tokens
  then give every logit the same bits, at the tiled kernel's speed;
- with -ffp-contract=off, so the compiler fuses no multiply-add the source does not ask for.
`--exact` downloads the source distribution, patches it, builds it (cached the same way) and unpacks
only its shared libraries into $SPECDEC_HOME/llama-exact/<version>-<EXACT_BUILD>/lib/, which
models/llama_cpp.py loads through llama-cpp-python's LLAMA_CPP_LIB_PATH in an exact process.

    python scripts/install_llama_cpp.py                     # build once, install into this Python
    python scripts/install_llama_cpp.py --exact             # the exact mode's libraries, once
    python scripts/install_llama_cpp.py --print-cmake-args  # just print the flags for this CPU
    python scripts/install_llama_cpp.py --cuda              # with CUDA as well (nvcc on the PATH), for --gpu-layers
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
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


EXACT_ARGS = "-DGGML_LLAMAFILE=OFF -DCMAKE_C_FLAGS=-ffp-contract=off -DCMAKE_CXX_FLAGS=-ffp-contract=off"
# Bumped whenever patch_exact changes what it builds (models/llama_cpp.EXACT_BUILD is the same).
EXACT_BUILD = "tiled1"


def exact_lib_dir() -> Path:
    """Where the exact build's libraries go (models/llama_cpp.exact_lib_dir reads the same place)."""
    return specdec_home() / "llama-exact" / f"{VERSION}-{EXACT_BUILD}" / "lib"


# The float end of one 256-value block in ggml's tiled matmul (tiled-kernel.cpp's epilogues):
#   r = d0 * float(s1); r = r - dmin0 * float(s2) (fused; K-quants with mins); acc += r * d1,
# fused on AVX2 with FMA, a multiply then an add in the AVX-512 VNNI kernel, where s1 and s2 are
# the block's exact integer sums. The dot products below end their blocks with this function.
EXACT_HELPER = r"""
#if defined(__AVX2__)
// specdec exact build: one 256-value block's end, as ggml's tiled matmul ends it (see
// scripts/install_llama_cpp.py in specdec). s1 (8 lanes) and s2 (4 lanes, K-quants with mins)
// hold parts of the block's integer sums, which are exact in any order.
static inline float specdec_exact_block(float acc, __m256i s1, __m128i s2, float d0, float dmin0, float d1,
                                        int has_min) {
    const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s1), _mm256_extracti128_si256(s1, 1));
    __m128i c = _mm_add_epi32(_mm_unpacklo_epi64(t, s2), _mm_unpackhi_epi64(t, s2));
    c = _mm_add_epi32(c, _mm_shuffle_epi32(c, _MM_SHUFFLE(2, 3, 0, 1)));  // [s1, s1, s2, s2]
    const __m128 f = _mm_cvtepi32_ps(c);
    __m128 r = _mm_mul_ss(_mm_set_ss(d0), f);
    if (has_min) {
#if defined(__FMA__)
        r = _mm_fnmadd_ss(_mm_set_ss(dmin0), _mm_movehl_ps(f, f), r);
#else
        r = _mm_sub_ss(r, _mm_mul_ss(_mm_set_ss(dmin0), _mm_movehl_ps(f, f)));
#endif
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(acc), _mm_mul_ss(r, _mm_set_ss(d1))));
#elif defined(__FMA__)
    return _mm_cvtss_f32(_mm_fmadd_ss(r, _mm_set_ss(d1), _mm_set_ss(acc)));
#else
    return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(acc), _mm_mul_ss(r, _mm_set_ss(d1))));
#endif
}
#endif
"""

# (function, [(old, new), ...]): each old must occur exactly once in the function's AVX2 section.
EXACT_DOT_EDITS = [
    (
        "void ggml_vec_dot_q4_K_q8_K(",
        [
            ("__m128 acc_m = _mm_setzero_ps();", "__m128 acc_m = _mm_setzero_ps();\n    float exact_acc = 0.0f;"),
            ("        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);\n", ""),
            (
                "__m256 vd = _mm256_set1_ps(d);\n        acc = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(sumi), acc);",
                "exact_acc = specdec_exact_block(exact_acc, sumi, prod,"
                " GGML_CPU_FP16_TO_FP32(x[i].d), GGML_CPU_FP16_TO_FP32(x[i].dmin), y[i].d, 1);",
            ),
            ("*s = hsum_float_8(acc) + _mm_cvtss_f32(acc_m);", "*s = exact_acc;"),
        ],
    ),
    (
        "void ggml_vec_dot_q6_K_q8_K(",
        [
            ("__m256 acc = _mm256_setzero_ps();", "__m256 acc = _mm256_setzero_ps();\n    float exact_acc = 0.0f;"),
            (
                "acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(sumi), acc);",
                "exact_acc = specdec_exact_block(exact_acc, sumi, _mm_setzero_si128(),"
                " GGML_CPU_FP16_TO_FP32(x[i].d), 0.0f, y[i].d, 0);",
            ),
            ("*s = hsum_float_8(acc);", "*s = exact_acc;"),
        ],
    ),
]

TILED_TYPES = "Q6_K Q5_K Q4_K Q3_K Q2_K IQ4_XS IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_S IQ1_M".split()
TILED_TYPES_OLD = "".join(f"        case GGML_TYPE_{t}:\n" for t in TILED_TYPES) + "            return true;\n"
TILED_TYPES_NEW = (
    "#if defined(__AVX2__) // specdec exact build: the types whose dot products end blocks as tiled does\n"
    "        case GGML_TYPE_Q6_K:\n        case GGML_TYPE_Q4_K:\n            return true;\n#endif\n"
)


# The dot products, patched, cost about 10% more than ggml's; the tiled kernel pays from about 20
# rows in the exact build (8 by default), so the exact build hands it 20 or more.
TILED_ROWS_OLD = "    return rows >= 8 || ggml_tiled_matmul_forced();"
TILED_ROWS_NEW = "    return rows >= 20 || ggml_tiled_matmul_forced(); // specdec exact build: from 20 rows"


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"patch_exact: expected one {old!r} in {where}, found {text.count(old)}")
    return text.replace(old, new)


def patch_exact(llama_dir: Path) -> None:
    """Patch a llama.cpp source tree (vendor/llama.cpp of the sdist) for the exact build."""
    quants = llama_dir / "ggml" / "src" / "ggml-cpu" / "arch" / "x86" / "quants.c"
    text = quants.read_text()
    # the helper goes right after hsum_i32_4 (x86 only, inside the same #if), which it does not use
    after = text.index("\n}\n", text.index("static inline int hsum_i32_4(")) + 3
    text = text[:after] + EXACT_HELPER + text[after:]
    for function, edits in EXACT_DOT_EDITS:
        start = text.index(function)
        avx2 = text.index("#if defined __AVX2__", start)
        end = text.index("#elif defined __AVX__", avx2)
        section = text[avx2:end]
        for old, new in edits:
            section = _replace_once(section, old, new, f"{function}...) in {quants}")
        text = text[:avx2] + section + text[end:]
    quants.write_text(text)
    tiled = llama_dir / "ggml" / "src" / "ggml-cpu" / "tiled" / "tiled.cpp"
    text = _replace_once(tiled.read_text(), TILED_TYPES_OLD, TILED_TYPES_NEW, str(tiled))
    tiled.write_text(_replace_once(text, TILED_ROWS_OLD, TILED_ROWS_NEW, str(tiled)))


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


def patched_source(where: Path) -> Path:
    """llama-cpp-python's source distribution of VERSION, unpacked into where and patched for the
    exact build; returns the unpacked project folder."""
    where.mkdir(parents=True)
    pip_download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
    run([*pip_download, "-d", str(where), f"llama-cpp-python=={VERSION}"])
    archives = sorted(where.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise SystemExit(f"pip download gave no source distribution of llama-cpp-python {VERSION} in {where}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(where, filter="data")
    project = where / archives[0].name.removesuffix(".tar.gz")
    patch_exact(project / "vendor" / "llama.cpp")
    return project


CUDA_ARGS = "-DGGML_CUDA=ON"  # --cuda: llama.cpp's layers may then run on an NVIDIA GPU (--gpu-layers)


def main() -> int:
    args = cmake_args()
    exact = "--exact" in sys.argv[1:]
    if "--cuda" in sys.argv[1:]:
        if exact:
            print("--cuda and --exact: the exact mode is the CPU's patched kernels; build them apart", file=sys.stderr)
            return 2
        if shutil.which("nvcc") is None:
            print("--cuda needs the CUDA compiler (nvcc) on the PATH; none found", file=sys.stderr)
            return 2
        args = f"{args} {CUDA_ARGS}".strip()
    if exact:
        args = f"{args} {EXACT_ARGS}".strip()
    if "--print-cmake-args" in sys.argv[1:]:
        print(args)
        return 0
    if exact and (exact_lib_dir() / "libllama.so").is_file():
        print(f"the exact build is in {exact_lib_dir()}")
        return 0
    build = f" {EXACT_BUILD}" if exact else ""
    tag = hashlib.sha256(f"{VERSION} {args} {sys.version_info[:2]}{build}".encode()).hexdigest()[:12]
    wheel_dir = specdec_home() / "wheels" / f"llama-cpp-python-{VERSION}-{tag}"
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl"))
    if not wheels:
        what = "the exact mode's build of llama-cpp-python" if exact else "llama-cpp-python"
        print(f"building {what} {VERSION} for this CPU (5-8 minutes, once)")
        print(f"CMAKE_ARGS={args}", flush=True)
        env = dict(os.environ, CMAKE_ARGS=args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        tmp = wheel_dir.with_name(wheel_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        source = f"llama-cpp-python=={VERSION}"
        if exact:
            source = str(patched_source(tmp / "src"))
        pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps", "-w", str(tmp), source]
        run(pip_wheel, env=env)
        shutil.rmtree(tmp / "src", ignore_errors=True)
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
