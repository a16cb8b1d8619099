"""Where specdec keeps files ($SPECDEC_HOME) and how it writes them: whole or not at all.

Imports nothing of specdec's: the catalog (models), the cost curves and the suffix cache all write
through here.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def specdec_home() -> Path:
    """$SPECDEC_HOME, else the user's cache dir (~/.cache/specdec)."""
    if os.environ.get("SPECDEC_HOME"):
        return Path(os.environ["SPECDEC_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "specdec"


def reason(exc: OSError) -> str:
    """An OSError's reason in a few words ("Permission denied"), without the errno and file name."""
    return exc.strerror or str(exc)


def read_text(path: str | os.PathLike, what: str) -> str:
    """A UTF-8 text file's text; else a SpecdecError that names `what` asked for it ("--config
    FILE") and why it could not be read."""
    from .errors import SpecdecError

    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecdecError(f"{what}: cannot read it ({reason(exc)})") from None
    except UnicodeDecodeError:
        raise SpecdecError(f"{what}: not UTF-8 text") from None


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` whole or not at all: into a temporary file in the same folder (a
    unique name, so two processes never share one), then os.replace, so a reader or a crash sees
    the old file or the new one, never half. The file gets the mode open() would give it (0o666
    less the umask, not mkstemp's 0600). The temporary file goes on any failure or interrupt;
    OSError is the caller's to report."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def writable_reason(path: str | os.PathLike) -> str | None:
    """Why a file could not be written at `path` later (None: it could), found now by creating
    and removing a temporary file beside it, so that a run whose result goes there learns it
    before the work, not after. A folder that exists but refuses new files says so (under /proc
    the system answers "No such file or directory")."""
    path = Path(path)
    folder = path.resolve().parent
    if path.is_dir():
        return "it is a folder"
    if not folder.is_dir():
        return f"no such folder {folder}"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is not writable"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        return f"cannot create files in {folder} ({reason(exc)})"
    os.close(fd)
    os.unlink(tmp)
    return None


_warned: set[str] = set()  # folders already warned about, so a run says it once


def write_cache_file(path: str | os.PathLike, text: str, fallback: str = "costs are kept in memory") -> bool:
    """Write `text` to `path` atomically (write_atomically), creating its folder. A cache that
    cannot be written (read-only SPECDEC_HOME, full disk) costs time, not correctness: one warning
    line on stderr per folder, saying `fallback`, and False."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text.encode("utf-8"))
        return True
    except OSError as exc:
        if str(path.parent) not in _warned:
            _warned.add(str(path.parent))
            print(
                f"specdec: warning: cannot write {path.parent} ({reason(exc)}); {fallback}",
                file=sys.stderr,
                flush=True,
            )
        return False
